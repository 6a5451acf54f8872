"""The model runner: one rank's forward step (inputs, attention metadata, DBO decision, sampling) and CUDA graphs."""
