"""The engine model's request path (model_repository/kvpop_engine): the service behind it (`model`), a request's
tensors parsed into one engine request (`parse`), the engine thread that bridges Triton and the engine
(`worker`), its configuration, chat rendering, response tensors, metrics and warm prefixes."""
