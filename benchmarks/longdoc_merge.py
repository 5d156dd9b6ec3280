"""Merge `ahakv-local eval longdoc` results.json files into one accuracy table (``longdoc.accuracy_table``; the
full cache's answer to each item once, from the first file that has it), rows ordered by compression, policy and
reading.

    python benchmarks/longdoc_merge.py longdoc-a/results.json longdoc-b/results.json ...
"""

import json
import sys

from ahakv_local.budget import READINGS
from ahakv_local.longdoc import LongdocTrial, accuracy_table

ORDER = ["full", "ahakv", "snapkv", "tova", "h2o", "scissorhands", "streaming", "random"]
trials, full_items = [], set()
for path in sys.argv[1:]:
    for r in json.load(open(path))["results"]:
        if r["label"] == "full":
            item = (r["task"], r["length"], r["depth"], r["trial"])
            if item in full_items:
                continue
            full_items.add(item)
        trials.append(LongdocTrial(**r))


def key(t):
    comp = 0.0 if t.label == "full" else float(t.label.split("@")[1].split("x")[0])
    return (comp, ORDER.index(t.policy), READINGS.index(t.reading))  # (every reading eval longdoc offers)


trials.sort(key=key)
print("\n".join(accuracy_table(trials)))
