"""Resolution: selectors, the option vocabulary, and a plan resolved against a model graph (the IR)."""
