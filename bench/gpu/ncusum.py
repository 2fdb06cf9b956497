# Sums Nsight Compute kernel times (gpu__time_duration.sum, CSV) per kernel name over the decode steps
# of a `gpucheck --profile-decode 3` run: the first quarter of the kernels (the prefill) is left out.
# With `prefill` after the file: every kernel of a `gpucheck --profile-prefill 1` run.
import csv, collections, sys
rows = [r for r in csv.DictReader(l for l in open(sys.argv[1]) if l.startswith('"'))]
ids = sorted({int(r["ID"]) for r in rows})
n = len(ids)
print("kernels profiled:", n)
prefill = sys.argv[2:] == ["prefill"]
steps = 1 if prefill else 3
cut = 0 if prefill or not n else ids[n // 4]
by = collections.defaultdict(float); cnt = collections.Counter(); dram = collections.defaultdict(float)
scale = {"byte": 1.0, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "KB": 1e3, "MB": 1e6, "GB": 1e9}
for r in rows:
    if int(r["ID"]) >= cut and r["Metric Name"] == "dram__bytes_read.sum":
        dram[r["Kernel Name"].split("(")[0]] += float(r["Metric Value"].replace(",", "")) * scale.get(r.get("Metric Unit", "byte"), 1.0) / steps
    if int(r["ID"]) >= cut and r["Metric Name"] == "gpu__time_duration.sum":
        v = float(r["Metric Value"].replace(",", ""))
        unit = r.get("Metric Unit", "nsecond")
        v *= {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3}.get(unit, 1e-3)
        name = r["Kernel Name"].split("(")[0]
        by[name] += v / steps; cnt[name] += 1
print(f"GPU microseconds per {'prefill' if prefill else 'decode step'}, by kernel (launches):")
for k, v in sorted(by.items(), key=lambda x: -x[1]):
    # Where DRAM bytes were measured: megabytes read and their rate.
    extra = f"  {dram[k] / 1e6:8.1f} MB  {dram[k] / v / 1e3:7.0f} GB/s" if dram.get(k) and v else ""
    print(f"  {k:24s} {v:9.1f}  ({cnt[k] // steps}){extra}")
print(f"  total                    {sum(by.values()):9.1f}")
