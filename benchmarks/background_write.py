"""How much a checkpoint written in a background thread slows the training threads beside it.

    python benchmarks/background_write.py            # 1.6 GB (the default model's save), nice 0 and 19

Runs a 2-thread matmul loop alone, then while a thread writes and fsyncs GB gigabytes at nice 0
and at nice 19 (common.BackgroundWriter's setting), and prints the loop's throughput kept.
"""

import argparse
import os
import threading
import time

import torch


def matmuls_per_s(seconds, a):
    t, n = time.perf_counter(), 0
    while time.perf_counter() - t < seconds:
        a @ a
        n += 1
    return n / (time.perf_counter() - t)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gb", type=float, default=1.6, help="gigabytes to write (default 1.6)")
    p.add_argument("--path", default="background_write.bin", help="file to write (removed after)")
    args = p.parse_args()
    chunk = torch.zeros(100_000_000, dtype=torch.uint8).numpy()                    # 0.1 GB
    a = torch.randn(1024, 1024)
    alone = matmuls_per_s(5, a)
    print(f"matmul loop alone: {alone:.1f}/s ({torch.get_num_threads()} threads)")
    for nice in (0, 19):
        took = []

        def write():
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
            t = time.perf_counter()
            with open(args.path, "wb") as f:
                for _ in range(round(args.gb * 10)):
                    f.write(memoryview(chunk))
                os.fsync(f.fileno())
            took.append(time.perf_counter() - t)

        thread = threading.Thread(target=write)
        thread.start()
        beside = matmuls_per_s(15, a)
        thread.join()
        os.remove(args.path)
        print(f"writer at nice {nice:2d}: loop kept {beside / alone:.0%} of its throughput for 15 s; "
              f"the {args.gb} GB write took {took[0]:.1f} s")
        time.sleep(5)


if __name__ == "__main__":
    main()
