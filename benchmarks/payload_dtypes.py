"""Payload size and round-trip error per payload dtype.

    python benchmarks/payload_dtypes.py
    python benchmarks/payload_dtypes.py --shapes 1x32 8x64 4x16x32 --std 1.0 --seed 0

For each latent shape (default (1, 32) and (8, 64)) and each payload dtype, a seeded Gaussian
latent (standard deviation `--std`; the trained encoder's mu is roughly of that order) goes
through pack -> to_bytes -> from_bytes -> unpack (float32). Printed per row: tensor bytes
(`byte_length()`: the values, plus the float32 row scales for int8), wire bytes
(`len(to_bytes())`), the wire format version, and the error of the received float32 latent
against the original: max absolute, RMS, and max absolute relative to each row's max |z|.
No model is loaded; it runs in about a second on a CPU.
"""

from __future__ import annotations

import argparse

import torch

from ilcp.wire.payload import DTYPES, TransportPayload, pack, unpack

FINGERPRINT = "b6ea7d5cd9274032"  # the length of a real LM fingerprint, so header sizes are real


def parse_shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(d) for d in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"shape must look like 8x64, got {text!r}") from None
    if not 1 <= len(shape) <= 3 or min(shape) < 1:
        raise argparse.ArgumentTypeError(f"shape must have 1 to 3 positive dimensions, got {text!r}")
    return shape


def measure(z: torch.Tensor, dtype: str) -> dict:
    """Sizes and errors of one round trip of z through the wire in `dtype`."""
    payload = pack(z, lm_fingerprint=FINGERPRINT, dtype=dtype)
    wire = payload.to_bytes()
    received = unpack(TransportPayload.from_bytes(wire, expected_fingerprint=FINGERPRINT), "cpu", dtype=torch.float32)
    err = (received.double() - z.double()).abs()
    row_max = z.double().abs().amax(dim=-1, keepdim=True).clamp_min(1e-30)
    return {
        "tensor_bytes": payload.byte_length(),
        "wire_bytes": len(wire),
        "version": wire[4],
        "max_abs": float(err.max()),
        "rms": float(err.pow(2).mean().sqrt()),
        "max_rel": float((err / row_max).max()),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", type=parse_shape, default=[(1, 32), (8, 64)],
                        help="latent shapes, e.g. 1x32 8x64 4x16x32")
    parser.add_argument("--std", type=float, default=1.0, help="standard deviation of the Gaussian latent")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    header = (f"{'shape':>10} {'dtype':>9} {'tensor B':>9} {'wire B':>7} {'ver':>3} "
              f"{'max abs err':>12} {'rms err':>10} {'max rel err':>12}")
    print(header)
    print("-" * len(header))
    for shape in args.shapes:
        z = torch.randn(shape, generator=torch.Generator().manual_seed(args.seed)) * args.std
        for dtype in DTYPES:
            m = measure(z, dtype)
            print(f"{'x'.join(map(str, shape)):>10} {dtype:>9} {m['tensor_bytes']:>9} {m['wire_bytes']:>7} "
                  f"{m['version']:>3} {m['max_abs']:>12.3e} {m['rms']:>10.3e} {m['max_rel']:>12.3e}")


if __name__ == "__main__":
    main()
