"""Merge `ahakv-local eval longdoc` results.json files into one accuracy table (``longdoc.accuracy_table``; the
full cache's rows from the first file only), rows ordered by compression, policy and reading.

    python benchmarks/longdoc_merge.py longdoc-a/results.json longdoc-b/results.json ...
"""

import json
import sys

from ahakv_local.longdoc import LongdocTrial, accuracy_table

ORDER = ["full", "ahakv", "snapkv", "tova", "h2o", "scissorhands", "streaming", "random"]
trials = []
for i, path in enumerate(sys.argv[1:]):
    for r in json.load(open(path))["results"]:
        if r["label"] != "full" or i == 0:
            trials.append(LongdocTrial(**r))


def key(t):
    comp = 0.0 if t.label == "full" else float(t.label.split("@")[1].split("x")[0])
    return (comp, ORDER.index(t.policy), ["plain", "query", "reconstruct"].index(t.reading))


trials.sort(key=key)
print("\n".join(accuracy_table(trials)))
