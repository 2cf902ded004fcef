# Ad-hoc diagnosis behind docs/quality/real/README.md "prompt lookahead": run at commit bf2342b (the lookahead
# code, reverted since) as: python lookahead_diagnosis.py TASK_INDEX LOOKAHEAD on build/real-tasks/val-2048-pk8.jsonl
# (validation split). Prints, for the needle tokens of one pass-key task, in how many of the 90 heads each ranks
# in the top 60 prompt tokens by the tail's attention and by the learned score. Not runnable on later commits.
import json, sys, numpy as np
sys.path.insert(0, ".")
from kvpop.engine import Engine, CacheConfig, GenerationRequest, SamplingParams
from kvpop.policies.kvpop import SCORE, LOOKAHEAD
from transformers import AutoTokenizer
tok = AutoTokenizer.from_pretrained("models/smollm2-135m-instruct")
tasks = [json.loads(l) for l in open("build/real-tasks/val-2048-pk8.jsonl")]
t = tasks[int(sys.argv[1])]; la = int(sys.argv[2])
ids = tok(t["prompt"], add_special_tokens=False).input_ids
ans = t["answer"] if isinstance(t["answer"], str) else t["answer"][0]
text_pos = t["prompt"].find(ans)
enc = tok(t["prompt"], add_special_tokens=False, return_offsets_mapping=True)
needle = [i for i, (a, b) in enumerate(enc.offset_mapping) if a >= text_pos - 12 and b <= text_pos + len(ans) + 2]
engine = Engine.from_model_dir("model_repository/kvpop_engine/1", prefill_chunk=256)
cfg = CacheConfig(policy="kvpop", budget=len(ids) + 40, scorer="mlstm", lookahead=la)
req = GenerationRequest("d", ids, SamplingParams(max_tokens=4), cfg)
engine.add_request(req)
while not engine._running: engine.step()
c = engine._running["d"].cache
pos = c.position; l = c.statistics[LOOKAHEAD]; s = c.statistics[SCORE]
order = np.argsort(pos, axis=2); l = np.take_along_axis(l, order, 2); s = np.take_along_axis(s, order, 2)  # by position
n = l.shape[2]; body = slice(4, len(ids) - 64)
lr = l - np.log(1.0 / np.arange(1, n + 1))[None, None]  # hmm: rough
rank_l = (l[:, :, body, None] > l[:, :, None, needle]).sum(2)  # L,Hkv,len(needle): how many body tokens beat it
rank_s = (s[:, :, body, None] > s[:, :, None, needle]).sum(2)
print("body tokens", body.stop - body.start)
for j, i in enumerate(needle):
    print(i, repr(tok.decode([ids[i]])), "lookahead max %.2f med %.2f | heads where in top 60 by lookahead %d, by learned %d" % (
        l[:, :, i].max(), np.median(l[:, :, i]), (rank_l[:, :, j] < 60).sum(), (rank_s[:, :, j] < 60).sum()))
