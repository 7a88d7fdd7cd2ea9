"""Today's hidden-state dump formats (SpecForge, ModelOpt, speculators): reading them into hsdata and writing
them back out. One module per format; :mod:`.importer` and :mod:`.exporter` drive them (``hsdata import`` and
``hsdata export``, docs/migrating.md).

Every format module has ``NAME``, ``FINAL_HIDDEN_STATE`` (what its final state is), ``find(src)`` (the sample
files, sorted relative paths), ``reader(src)`` (an object whose ``read(rel)`` returns a :class:`SourceSample` or
raises :class:`~.common.BadSourceError`) and ``Exporter`` (writes samples in the format); :mod:`.common` holds
what they share. This package only names them (the command line builds its options from it without loading
torch).
"""

from __future__ import annotations

FORMAT_NAMES = ("specforge", "modelopt", "speculators")


def get(name: str):
    """The format module called ``name``."""
    if name == "specforge":
        from . import specforge as module
    elif name == "modelopt":
        from . import modelopt as module
    elif name == "speculators":
        from . import speculators as module
    else:
        raise ValueError(f"unknown format {name!r}; one of {', '.join(FORMAT_NAMES)}")
    return module
