import json, sys, glob, os
for path in sorted(glob.glob(sys.argv[1] + "/**/*decode-step-profile.json", recursive=True)):
    d = json.load(open(path)); r = d["rows"][0] if "rows" in d else d
    rows = d.get("rows") or d.get("results") or [d]
    for row in rows:
        t = row["trace"]
        pick = {}
        for k in t["top"]:
            n = k["name"]
            key = ("skinny" if "skinny" in n else "norm" if "rms_norm" in n else "attn" if "ragged" in n else
                   "rope" if "rope" in n else "gemm" if any(w in n.lower() for w in ("gemm", "xmma", "nvjet", "cutlass")) else None)
            if key: pick[key] = pick.get(key, 0) + k["us_per_step"]
        print(os.path.relpath(path, sys.argv[1]), row["context"], "full %.3f pipe %.3f kern %.3f span %.3f" % (row["full_ms"], row["pipelined_ms"], t["kernel_ms_per_step"], t["span_ms_per_step"]),
              {k: round(v / 32, 2) for k, v in pick.items()})
