"""bench/kinds.py: a profiled step's time by kind of op beside memplan's meta clock. The
kernel and op names below are the ones torch's CUDA and CPU kernels carry."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pytest

from bench.kinds import MODEL_TEXT, ROOT, SHAPES, kind_of_cpu_op, kind_of_kernel


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        # cuBLAS on sm90 and sm80, its Hopper "nvjet" kernels, CUTLASS
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1_"
         "execute_segment_k_off_kernel__5x_cublas", "GEMMs"),
        ("ampere_bf16_s16816gemm_bf16_128x256_ldg8_f2f_stages_64x3_tn", "GEMMs"),
        ("nvjet_hsh_256x128_64x4_1x2_h_bz_coopA_NNT", "GEMMs"),
        ("void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_32x32_128x1_tn>",
         "GEMMs"),
        # FlashAttention-2 (torch's flash kernels), memory-efficient (xformers' CUTLASS fmha),
        # cuDNN's fused SDPA: attention before the GEMM rule ("cutlass" in fmha's name)
        ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>>",
         "attention"),
        ("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<...>", "attention"),
        ("fmha_cutlassF_bf16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel)",
         "attention"),
        ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x128x128", "attention"),
        # elementwise, reductions, copies, the loss
        ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>>",
         "memory-bound ops"),
        ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, MeanOps<float>>>",
         "memory-bound ops"),
        ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float>", "memory-bound ops"),
        ("Memcpy DtoD (Device -> Device)", "memory-bound ops"),
        # inductor's kernels under torch.compile: its mm templates, its fused pointwise and
        # reduction kernels
        ("triton_tem_fused_mm_0", "GEMMs"),
        ("triton_tem_fused_addmm_relu_3", "GEMMs"),
        ("triton_poi_fused__to_copy_add_mul_rsqrt_2", "memory-bound ops"),
        ("triton_red_fused__to_copy_mean_pow_1", "memory-bound ops"),
        ("triton_per_fused_mul_sum_4", "memory-bound ops"),
    ],
)  # fmt: skip
def test_a_cuda_kernel_is_sorted_by_its_name(name, kind):
    assert kind_of_kernel(name) == kind


def test_a_cpu_op_is_sorted_by_its_aten_name_and_the_rest_left_out():
    assert [kind_of_cpu_op(n) for n in ("aten::mm", "aten::addmm", "aten::bmm")] == ["GEMMs"] * 3
    assert kind_of_cpu_op("aten::_scaled_dot_product_flash_attention_for_cpu") == "attention"
    assert kind_of_cpu_op("aten::_scaled_dot_product_flash_attention_for_cpu_backward") == (
        "attention"
    )
    assert (
        kind_of_cpu_op("aten::mul") == kind_of_cpu_op("aten::_log_softmax") == ("memory-bound ops")
    )
    # autograd's nodes and the profiler's records are no op of the model's
    assert kind_of_cpu_op("autograd::engine::evaluate_function: MmBackward0") is None
    assert kind_of_cpu_op("ProfilerStep#1") is None


def test_the_measured_model_is_the_llama_of_the_examples_at_the_gpu_shapes(tmp_path):
    """The model file the section writes builds examples/llama70b.py's Llama: on a GPU two
    blocks of Llama 3.1 8B's shapes (4096 × 14336, 32 heads over 8, vocabulary 128256),
    parameters counted by hand."""
    from memplan.model.loader import load_model_file

    shape, batch = SHAPES["cuda"]
    path = tmp_path / "m.py"
    path.write_text(MODEL_TEXT.format(examples=str(ROOT / "examples"), shape=shape))
    mf = load_model_file(f"{path}:build_model")
    import torch

    with torch.device("meta"):
        model = mf.build_model()
    h, f, v = 4096, 14336, 128256
    block = 2 * h + h * h * 2 + h * 1024 * 2 + 3 * h * f  # norms, q/o, k/v (8 × 128), MLP
    assert sum(p.numel() for p in model.parameters()) == 2 * block + h + 2 * v * h
    assert batch == 2 and shape[-1] == 8192
