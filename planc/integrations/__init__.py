"""Using plans inside training frameworks: Hugging Face Trainer (`hf`), Lightning (`lightning`).

Each module is small and imports its framework only when called; docs/trainers.md shows the
recipes, torchtitan's included (which needs no code here).
"""
