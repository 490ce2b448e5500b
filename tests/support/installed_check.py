"""Run by tests/test_wheels.py with the python of a fresh environment where the built wheels
were installed beside transformers, PEFT and Hugging Face's `kernels`; it imports nothing of
the checkout. Prints one JSON object:

    python installed_check.py MODEL_DIR WORKDIR PROMPT_IDS MAX_TOKENS

- "shared": files that more than one installed distribution lists in its RECORD;
- "kernels": the file `import kernels` gives (Hugging Face's, in site-packages);
- "hf": transformers' greedy continuation of PROMPT_IDS on the model, float32 on the CPU;
- "served": the tokens `loramux serve` (this environment's entry point) streams for it.
"""
from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from collections import defaultdict
from importlib import metadata
from pathlib import Path


def shared_files() -> dict[str, list[str]]:
    owners = defaultdict(set)
    for dist in metadata.distributions():
        for f in dist.files or ():
            if "__pycache__" not in f.parts and not f.name.endswith(".pyc"):
                owners[str(f)].add(dist.metadata["Name"])
    return {f: sorted(d) for f, d in owners.items() if len(d) > 1}


def hf_greedy(model_dir: str, prompt: list[int], max_tokens: int) -> list[int]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens,
                             do_sample=False, attention_mask=torch.ones(1, len(prompt),
                                                                        dtype=torch.long))
    return out[0, len(prompt):].tolist()


def served(model_dir: str, workdir: Path, prompt: list[int], max_tokens: int) -> list[int]:
    from loramux import GenerateClient

    bin_dir = Path(sys.executable).parent
    (workdir / "adapters").mkdir(parents=True, exist_ok=True)
    err_path = workdir / "serve.stderr"
    with open(err_path, "w") as err:
        proc = subprocess.Popen(
            [str(bin_dir / "loramux"), "serve", "--model", model_dir, "--adapter-root",
             str(workdir / "adapters"), "--workdir", str(workdir / "run"), "--device", "cpu",
             "--gateway-port", "0", "--control-port", "0", "--http-port", "0",
             "--metrics-port", "-1", "--shutdown-grace", "2"],
            cwd=workdir, stdout=subprocess.DEVNULL, stderr=err)
    try:
        deadline = time.monotonic() + 300
        while "loramux serving" not in err_path.read_text(errors="replace"):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"serve did not start:\n{err_path.read_text()[-3000:]}")
            time.sleep(0.2)
        gateway = re.search(r"^\s+gateway\s+(\S+)", err_path.read_text(), re.M).group(1)
        with GenerateClient(gateway) as client:
            return list(client.generate(prompt, None, temperature=0.0,
                                        max_tokens=max_tokens, timeout=120).token_ids)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def main() -> None:
    model_dir, workdir, prompt, max_tokens = sys.argv[1:5]
    prompt_ids, n = json.loads(prompt), int(max_tokens)
    import kernels

    print(json.dumps({"shared": shared_files(), "kernels": kernels.__file__,
                      "hf": hf_greedy(model_dir, prompt_ids, n),
                      "served": served(model_dir, Path(workdir), prompt_ids, n)}))


if __name__ == "__main__":
    main()
