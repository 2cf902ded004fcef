"""The OpenAI-compatible HTTP API (`/v1/chat/completions`, `/v1/completions`, `/v1/models`).

A separate process beside tritonserver: it translates each OpenAI request into one `kvpop_engine`
request over Triton's gRPC streaming API and the engine's responses back into OpenAI's bodies and SSE
chunks. Streaming from the engine in every case is what lets a client that goes away cancel its
generation: closing the gRPC stream cancels the Triton request and the engine frees its slots at its
next step. The engine itself knows nothing of OpenAI.
"""
