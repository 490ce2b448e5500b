"""Small stand-ins for the vLLM and SGLang wheels of benchmarks/peer_sources.py: a wheel
(a zip named as theirs) with a file at each path the benchmark takes, and in it the
functions it calls with their signatures, computed in plain torch, importing the helpers
of their packages that benchmarks/peer_shims.py stands in for. `wrong=True` makes SGLang's
expand add its delta twice: a peer that disagrees with the reference."""
from __future__ import annotations

import zipfile
from pathlib import Path

from benchmarks.peer_sources import PeerSpec

_VLLM = "vllm/lora/ops/triton_ops/"
_SGLANG = "sglang/kernels/ops/lora/dense/"

VLLM_FILES = {
    _VLLM + "kernel_utils.py": '''
from vllm.triton_utils import tl, triton

@triton.jit
def do_nothing(x_ptr, N: tl.constexpr):
    pass
''',
    _VLLM + "utils.py": '''
from vllm import envs
from vllm.logger import init_logger
from vllm.platforms import current_platform
from vllm.utils.math_utils import next_power_of_2
from vllm.utils.torch_utils import async_tensor_h2d

logger = init_logger(__name__)
ON_CUDA = current_platform.is_cuda()
TUNED = envs.VLLM_TUNED_CONFIG_FOLDER
POW2_OF_5 = next_power_of_2(5)
_LORA_A_PTR_DICT = {}
_LORA_B_PTR_DICT = {}
''',
    _VLLM + "lora_kernel_metadata.py": '''
import torch

class LoRAKernelMeta:
    @staticmethod
    def make(max_loras, max_num_tokens, device, captured_lora_counts=None):
        meta = LoRAKernelMeta()
        meta.device = device
        return meta

    def prepare_tensors(self, token_lora_mapping):
        self.mapping = token_lora_mapping.clone()

    def meta_args(self, token_nums, specialize_active_lora):
        none = torch.zeros(1)
        return (self.mapping[:token_nums], none, none, none, none,
                torch.tensor([False]), torch.tensor([1]))
''',
    _VLLM + "lora_shrink_op.py": '''
import torch
from vllm.lora.ops.triton_ops.kernel_utils import do_nothing
from vllm.lora.ops.triton_ops.utils import async_tensor_h2d
from vllm.utils.torch_utils import direct_register_custom_op

def _lora_shrink(inputs, lora_a_weights, output_tensor, token_lora_mapping, sorted_ids,
                 num_tokens_per_lora, lora_token_start_loc, lora_ids, no_lora_flag_cpu,
                 num_active_loras, scaling):
    idx = token_lora_mapping.long()
    for s, a in enumerate(lora_a_weights):          # a: (L, 1, R, K)
        w = a[:, 0].index_select(0, idx).float()    # (T, R, K)
        output_tensor[s] = torch.einsum("tk,trk->tr", inputs.float(), w) * scaling

try:
    direct_register_custom_op(op_name="lora_shrink", op_func=_lora_shrink,
                              mutates_args=["output_tensor"])
    lora_shrink = torch.ops.vllm.lora_shrink
except AttributeError:
    lora_shrink = _lora_shrink
''',
    _VLLM + "lora_expand_op.py": '''
import torch

def lora_expand(inputs, lora_b_weights, output_tensor, token_lora_mapping, *meta,
                offset_start=0, add_inputs=False):
    idx = token_lora_mapping.long()
    lo = offset_start
    for s, b in enumerate(lora_b_weights):          # b: (L, 1, n, R)
        w = b[:, 0].index_select(0, idx).float()    # (T, n, R)
        d = torch.einsum("tr,tnr->tn", inputs[s], w)
        hi = lo + w.shape[1]
        out = output_tensor[:, lo:hi]
        out.copy_((out.float() + d if add_inputs else d).to(out.dtype))
        lo = hi
''',
}

SGLANG_FILES = {
    _SGLANG + "lora_tuning_config.py": '''
import json
import os
from sglang.srt.utils import get_device_name

HERE = os.path.dirname(os.path.realpath(__file__))
CONFIG = json.load(open(os.path.join(HERE, "csgmv_configs", "triton_3_5_1", "c.json")))
DEVICE = get_device_name()
''',
    _SGLANG + "csgmv_configs/triton_3_5_1/c.json": '{"16": {"BLOCK_N": 16}}',
    _SGLANG + "chunked_sgmv_shrink.py": '''
import torch
from sglang.kernels.ops.lora.dense.lora_tuning_config import CONFIG
from sglang.srt.environ import envs
from sglang.srt.lora.utils import LoRABatchInfo
from sglang.srt.utils import cached_triton_kernel

SPLIT_K = envs.SGLANG_ENABLE_LORA_CSGMV_SPLIT_K.get()

def segments(info):
    for i in range(info.num_segments):
        lo, hi = int(info.seg_indptr[i]), int(info.seg_indptr[i + 1])
        assert hi - lo <= info.max_len
        yield info.permutation[lo:hi].long(), int(info.weight_indices[i])

def chunked_sgmv_lora_shrink_forward(x, weights, batch_info: LoRABatchInfo, num_slices):
    out = torch.zeros(x.shape[0], weights.shape[1], dtype=x.dtype)
    for rows, w in segments(batch_info):
        out[rows] = (x[rows].float() @ weights[w].float().T).to(x.dtype)
    return out
''',
    _SGLANG + "chunked_sgmv_expand.py": '''
from sglang.kernels.ops.lora.dense.chunked_sgmv_shrink import segments

TIMES = 1

def chunked_sgmv_lora_expand_forward(x, weights, batch_info, slice_offsets, max_slice_size,
                                     base_output, slice_offsets_cpu=None):
    offs = slice_offsets_cpu.tolist()
    r = weights.shape[2]
    for rows, w in segments(batch_info):
        for s, (lo, hi) in enumerate(zip(offs, offs[1:])):
            d = x[rows, s * r:(s + 1) * r].float() @ weights[w, lo:hi].float().T
            d = d * float(batch_info.scalings[w]) * TIMES
            base_output[rows, lo:hi] = (base_output[rows, lo:hi].float() + d).to(
                base_output.dtype)
    return base_output
''',
}


def build_wheel(spec: PeerSpec, into: Path, wrong: bool = False) -> Path:
    """A wheel-shaped zip of `spec`'s pinned name and version with the fake files."""
    files = dict(VLLM_FILES if spec.name == "vllm" else SGLANG_FILES)
    if wrong and spec.name == "sglang":
        key = _SGLANG + "chunked_sgmv_expand.py"
        files[key] = files[key].replace("TIMES = 1", "TIMES = 2")
    into.mkdir(parents=True, exist_ok=True)
    wheel = into / f"{spec.name}-{spec.version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for name, text in files.items():
            zf.writestr(name, text.lstrip("\n"))
        zf.writestr(f"{spec.name}-{spec.version}.dist-info/METADATA",
                    f"Metadata-Version: 2.1\nName: {spec.name}\nVersion: {spec.version}\n")
        zf.writestr(f"{spec.name}-{spec.version}.dist-info/WHEEL",
                    "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr(f"{spec.name}-{spec.version}.dist-info/RECORD", "")
        zf.writestr(f"{spec.name}/other/unrelated.py", "raise ImportError('not taken')\n")
    return wheel
