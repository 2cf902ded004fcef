"""kvpop_service before the fix, reduced to its threading: BLS from pool threads, responses sent from
them, a watcher polling is_cancelled(). KVPOP_REPRO_WATCHER=0 turns the watcher off.
KVPOP_REPRO_HOLD=1 keeps Python's references to each BLS iterator and its responses for 5 s, so the
stub's IPC thread never drops the last reference to them (the suspected cause: tensors holding Python
objects released there without the GIL)."""
import collections
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.pool = ThreadPoolExecutor(256)
        self.in_flight, self.lock = {}, threading.Lock()
        self.hold = os.environ.get("KVPOP_REPRO_HOLD", "0") == "1"
        self.held = collections.deque()  # (time, objects) kept alive for a while
        if os.environ.get("KVPOP_REPRO_WATCHER", "1") == "1":
            threading.Thread(target=self._watch, daemon=True).start()
        if self.hold:
            threading.Thread(target=self._release_held, daemon=True).start()

    def execute(self, requests):
        for request in requests:
            self.pool.submit(self._answer, request, request.get_response_sender())
        return None

    def _answer(self, request, sender):
        key = object()
        with self.lock:
            self.in_flight[key] = request
        inputs = [pb_utils.get_input_tensor_by_name(request, name) for name in ("text_input", "count")]
        final, responses = None, []
        iterator = pb_utils.InferenceRequest(model_name="echo_decoupled", inputs=inputs,
                                             requested_output_names=["text_output", "output_ids"]).exec(decoupled=True)
        for response in iterator:
            responses.append(response)
            if response.output_tensors():
                final = response
        with self.lock:
            del self.in_flight[key]
        tensors = final.output_tensors()
        sender.send(pb_utils.InferenceResponse(output_tensors=tensors), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        if self.hold:
            with self.lock:
                self.held.append((time.time(), (iterator, responses, tensors, inputs)))

    def _release_held(self):
        while True:
            time.sleep(0.5)
            with self.lock:
                while self.held and time.time() - self.held[0][0] > 5:
                    self.held.popleft()

    def _watch(self):
        while True:
            time.sleep(0.05)
            with self.lock:
                for request in list(self.in_flight.values()):
                    request.is_cancelled()
