#!/usr/bin/env python3
"""Writes the initial seed corpora (fuzz/corpus/<fuzzer>/seed_*): deterministic pseudo-random
programs, a few per cache kind / kernel / session source / Highway target. Every byte string decodes to a valid
program (the readers pad with zeros), so random bytes with a fixed head are good seeds; libFuzzer
grows the corpus from there. Re-run only to reset the seeds."""
import os
import random

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus")


def write(fuzzer, name, data):
    d = os.path.join(ROOT, fuzzer)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(bytes(data))


def main():
    rng = random.Random(20240607)
    # fuzz_cache: byte 0 target, byte 1 kind, then kind parameters and ops. Start most programs
    # with SetConfig (op 0) + Init (op 1) so the first ops reach StartForward/Put.
    for kind in range(6):
        for i in range(6):
            head = [i, kind] + [rng.randrange(256) for _ in range(8)]
            init = [16 * rng.randrange(2) + 1, rng.randrange(3), 1 + rng.randrange(200),
                    rng.randrange(256), 1 + rng.randrange(200)]
            body = [rng.randrange(256) for _ in range(rng.choice([60, 200, 600]))]
            write("fuzz_cache", f"seed_kind{kind}_{i}", head + init + body)
    # fuzz_kernels: byte 0 target, byte 1 kernel (0..6), then data.
    for kernel in range(7):
        for target in range(4):
            body = [rng.randrange(256) for _ in range(rng.choice([64, 400, 2000]))]
            write("fuzz_kernels", f"seed_k{kernel}_t{target}", [target, kernel] + body)
    # fuzz_sequence_cache: byte 0 target, then configuration and ops.
    for i in range(16):
        body = [rng.randrange(256) for _ in range(rng.choice([50, 200, 800]))]
        write("fuzz_sequence_cache", f"seed_{i}", [i % 4, i % 7] + body)
    # fuzz_session: byte 0 target, byte 1 source (0 causal family, 1 wrapper of SWA + causal,
    # 2 growing / rotating, 3 encoder), then the shape, the fill, the damage and the repair flags.
    # A separate generator so that adding these seeds left the streams above unchanged.
    srng = random.Random(20261125)
    for source in range(4):
        for i in range(4):
            body = [srng.randrange(256) for _ in range(srng.choice([40, 160, 600]))]
            write("fuzz_session", f"seed_src{source}_{i}", [i % 4, source] + body)


if __name__ == "__main__":
    main()
