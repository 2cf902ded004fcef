"""The learned KVpop scorer's training side (torch): targets, network, traces, training, ONNX export.

The kinds are defined once, in `kvpop.policies.kvpop.LEARNED_SCORER_KINDS`; serving runs the exported ONNX
through `kvpop.policies.kvpop.runtime` without torch. Import the modules directly.
"""
