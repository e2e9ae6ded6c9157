"""The model side: a model built from a reference (on meta), and its module graph."""
