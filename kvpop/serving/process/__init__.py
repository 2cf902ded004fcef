"""The processes that serve the models: the launcher (`make serve`, the container), the supervisor, the
tritonserver process and its Python backend stubs, the ports checked before start, the state directory that
outlives them and the drain signal of a shutdown."""
