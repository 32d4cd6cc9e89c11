import json, sys, glob, os
for path in sorted(glob.glob(sys.argv[1] + "/**/*decode-step-profile.json", recursive=True)):
    d = json.load(open(path))
    for row in d["rows"]:
        t = row["trace"]
        print(os.path.relpath(path, sys.argv[1]), row["context"], "full %.3f pipe %.3f kern %.3f span %.3f n %d" % (row["full_ms"], row["pipelined_ms"], t["kernel_ms_per_step"], t["span_ms_per_step"], t["kernels_per_step"]))
        print("   ", [(k["name"][:24], round(k["us_per_step"] / 32, 2)) for k in t["top"][:11]])
