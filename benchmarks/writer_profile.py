"""Where the compressed writer's time goes on 16 cores: interleaved timed writes (uncompressed, zstd) of the
write_bench chat mix, then zstd writes under py-spy (--idle --threads, and --gil), raw stacks to OUT."""
import os, signal, subprocess, sys, time
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import write_bench as wb

out, directory = sys.argv[1], sys.argv[2]
hidden, layers = 4096, 3
lengths = wb.make_lengths("chat", int(8 * 2**30 / wb.token_bytes(hidden, layers)), 0)
samples = wb.make_samples(lengths, hidden, layers, 0, "normal")
nbytes = sum(wb.sample_nbytes(s) for s in samples)
wb.warm_up(lambda d, s: wb.write_hsdata(d, s, hidden, layers, method="hsdata zstd"), directory + ".w", hidden, layers, 0, "normal")

def timed(method, spy=None):
    wb.clear(directory)
    proc = None  # py-spy (pip install py-spy) records the process itself
    if spy:
        proc = subprocess.Popen(["py-spy", "record", "--pid", str(os.getpid()), "-r", "250", "--format", "raw",
                                 "--threads", *spy[1:], "-o", f"{out}/{spy[0]}.txt"], stdout=subprocess.DEVNULL)
        time.sleep(1.5)
    t, c = time.perf_counter(), os.times()
    wb.write_hsdata(directory, samples, hidden, layers, method=method)
    t, c2 = time.perf_counter() - t, os.times()
    if proc:
        proc.send_signal(signal.SIGINT); proc.wait()
    print(f"{method:12s} {spy[0] if spy else '':10s} {nbytes / t / 1e9:.2f} GB/s  user {(c2.user - c.user) / t:.1f} "
          f"sys {(c2.system - c.system) / t:.1f} cores", flush=True)

for _ in range(2):
    timed("hsdata"); timed("hsdata zstd")
timed("hsdata zstd", ("idle", "--idle"))
timed("hsdata zstd", ("gil", "--gil"))
timed("hsdata", ("plain_idle", "--idle"))
wb.clear(directory)
