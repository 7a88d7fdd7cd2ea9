"""Extraction: running a target model over conversations and storing its hidden states.

``capture`` turns prefill forwards into committed samples (the one path behind both front ends), ``engine_hf`` runs
a transformers model in process (``hsdata extract --engine hf``, one rank of ``distributed`` each), ``client``
drives a running SGLang server whose hook (``server_hook/``) captures, ``conversations`` reads the input data and
``demo`` holds the embedded default model and data."""
