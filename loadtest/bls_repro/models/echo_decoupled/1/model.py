"""Decoupled echo model for the BLS reproducer: a worker thread answers like an LLM engine does."""
import queue
import threading

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.work = queue.Queue()
        threading.Thread(target=self._serve, daemon=True).start()

    def execute(self, requests):
        for request in requests:
            text = pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy()
            count = int(pb_utils.get_input_tensor_by_name(request, "count").as_numpy().reshape(-1)[0])
            self.work.put((request.get_response_sender(), text.copy(), count))
        return None

    def _serve(self):
        while True:
            sender, text, count = self.work.get()
            for index in range(count):
                outputs = [pb_utils.Tensor("text_output", text), pb_utils.Tensor("output_ids", np.arange(64, dtype=np.int64).reshape(1, -1))]
                flags = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if index == count - 1 else 0
                sender.send(pb_utils.InferenceResponse(output_tensors=outputs), flags=flags)
