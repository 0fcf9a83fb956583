"""The llama.cpp backend: whole-model execution by llama-cpp-python behind our runner interface."""
