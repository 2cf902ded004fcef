"""The front end (model_repository/kvpop_service): a client request's batch of prompts checked and reshaped
(`frontend`), each sent to the engine model over its own gRPC stream (`forwarder`)."""
