"""Summarize py-spy raw (collapsed) stacks: per thread group, share of samples by leaf frame."""
import collections, re, sys
for path in sys.argv[1:]:
    per = collections.defaultdict(collections.Counter)
    totals = collections.Counter()
    for line in open(path):
        stack, _, n = line.rstrip().rpartition(" ")
        frames = stack.split(";")
        thread = re.sub(r"_\d+$", "", re.sub(r"\(.*?\)", "", frames[0])).strip().strip('"')
        thread = re.sub(r"[-_]\d+T\d+-[0-9a-f]+.*", "", thread)
        leaf = frames[-1] if len(frames) > 1 else "?"
        leaf = re.sub(r"\s*\(.*?:(\d+)\)", r":\1", leaf)
        per[thread][leaf] += int(n); totals[thread] += int(n)
    print("==", path, sum(totals.values()))
    for thread, total in totals.most_common(12):
        print(f"  {thread} {total}")
        for leaf, n in per[thread].most_common(6):
            print(f"      {n / total:6.1%} {leaf}")
