"""Adapters that hand a store to other projects' trainers (each module imports its project; see docs/training.md)."""
