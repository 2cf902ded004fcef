"""The Triton-facing layer, one package per concern: the wire contract and the engine stream client (this
package's own modules), the engine model's request path (`kvpop_engine`), the front end (`kvpop_service`) and
the processes that serve them (`process`). Each Triton model's package is named after the model it backs."""
