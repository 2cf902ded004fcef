"""The learned KVpop scorer: targets, network, traces and training (torch), ONNX export and runtime.

Only `runtime` is needed at serve time and imports no torch; import the modules directly.
"""
