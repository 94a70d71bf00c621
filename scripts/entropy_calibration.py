"""How strongly ``learner.entropy_coef`` holds a policy's choice entropy (docs/benchmarks.md, "An entropy
bonus against the collapse"): one quick-game prompt, three choices, the samples that took the second one
rewarded (+1, the others -0.5), the same batch stepped again and again by a LoRA lane, which is the
collapse in small. Prints the entropy before each of ``--steps`` steps, per coefficient.

    .venv/bin/python scripts/entropy_calibration.py --model smollm2-135m-instruct 0 0.3 0.5 1 --json FILE
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
from pathlib import Path

from coevo.algorithm.prompts import INDEX_LABELS, policy_prompt
from coevo.config import LearnerConfig
from coevo.envs.textworld_env import default_cache_dir
from coevo.inference.engine import LocalEngine
from coevo.inference.gguf import resolve_model
from coevo.schemas import TrainingSample
from coevo.training.lane import Lane
from coevo.training.parity import as_sample


async def choice_samples(model: Path, n: int) -> list[TrainingSample]:
    prompt = policy_prompt(
        "goal: take the coin. room: hall. items: coin, key. exits: north attic.", ["go north", "take coin", "take key"]
    )
    async with LocalEngine(model, seed=1) as eng:
        done = await asyncio.gather(*(eng.complete(prompt, choices=list(INDEX_LABELS[:3])) for _ in range(n)))
    return [as_sample(c, f"s{i}", "policy", advantage=1.0 if c.choice == 1 else -0.5) for i, c in enumerate(done)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("coefs", type=float, nargs="+", help="learner.entropy_coef values")
    parser.add_argument("--model", default="smollm2-135m-instruct", help="a model directory, GGUF file or short name")
    parser.add_argument("--cache-dir", type=Path, help="where converted models live (default: coevo's cache)")
    parser.add_argument("--lr", type=float, default=3e-4, help="learner.lr (configs/smollm2.toml's)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--json", type=Path, help="also write the settings and every entropy here")
    args = parser.parse_args()
    model = resolve_model(args.model, args.cache_dir or default_cache_dir())
    samples = asyncio.run(choice_samples(model, args.samples))
    taken = sorted(s.response_token_ids[0] for s in samples)
    print("choices taken:", taken)
    result: dict[str, object] = {"model": args.model, "lr": args.lr, "samples": args.samples, "choices_taken": taken}
    for coef in args.coefs:
        with tempfile.TemporaryDirectory() as tmp:
            cfg = LearnerConfig(lora={}, lr=args.lr, entropy_coef=coef)
            lane = Lane("policy", model, Path(tmp), cfg, device="cpu")
            entropy = [lane.step(samples, [f"g{i}"]).entropy or 0.0 for i in range(args.steps)]
            print(f"entropy_coef {coef}:", " ".join(f"{h:.3f}" for h in entropy), flush=True)
            result[f"entropy_coef={coef:g}"] = [round(h, 4) for h in entropy]
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
