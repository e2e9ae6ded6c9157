"""Analysis of a compiled plan: the traced step, memory model, simulation, explain report, plot."""
