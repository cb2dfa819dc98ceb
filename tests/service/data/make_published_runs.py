"""Writes published_runs.json (beside this file) from the tables transcribed below; run it after editing them:

    python tests/service/data/make_published_runs.py

Each source records where its figures come from, what was measured and the settings the planner is given.
"""

import json
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent

SOURCES = {
    "narayanan2021": {
        "title": (
            "Narayanan et al., Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM, "
            "SC21, Table 1 (weak scaling)"
        ),
        "url": "https://arxiv.org/abs/2104.04473",
        "hardware": (
            "Selene: DGX A100 80GB nodes, 8 GPUs/node on NVLink3/NVSwitch, 8 x HDR 200 Gb/s InfiniBand per node"
        ),
        "measured": (
            "achieved teraFLOP/s per GPU, end-to-end (data loading, optimizer and logging included), FLOPs "
            "counted with eq. (3): 96 B s l h^2 (1 + s/(6h) + V/(16 l h)) (full activation recomputation)"
        ),
        "settings": (
            "GPT, vocab 51200, sequence 2048, mixed precision fp16, full activation recomputation, tensor model "
            "parallel t, pipeline p, data parallel n/(t p); micro-batch sizes of Megatron-LM's "
            "examples/sc21/run_table_1.sh (16, 16, 16, 8, 4, 2, 2, 1, 1, 1 from 1.7B to 1T); pipeline schedule "
            "not given per row: 1F1B assumed; fused (non-flash, unfused-softmax) attention"
        ),
        "step_time": "step_time_s = 96 B s l h^2 (1 + s/(6h) + V/(16 l h)) / (GPUs x TFLOP/s per GPU)",
    },
    "korthikanti2022": {
        "title": (
            "Korthikanti et al., Reducing Activation Recomputation in Large Transformer Models, 2022, Table 3 "
            "(configurations) and the end-to-end iteration time table"
        ),
        "url": "https://arxiv.org/abs/2205.05198",
        "hardware": "Selene: DGX A100 80GB nodes (as Narayanan et al.)",
        "measured": (
            "seconds per iteration, end-to-end; MFU 41.5 / 51.4 / 56.0 / 56.3 % for 22B / 175B / 530B / 1T with "
            "the paper's techniques"
        ),
        "settings": (
            "GPT, vocab 51200, sequence 2048, micro-batch 1, mixed precision; 'full recompute' = tensor parallel "
            "+ full activation recomputation; 'present work' = tensor + sequence parallel + selective "
            "(attention-core) recomputation; non-flash attention; data parallel 1"
        ),
        "step_time": "as published",
    },
    "bigscience_tr11": {
        "title": (
            "BigScience tr11-176B-ml chronicles-prequel, 'GBS Variations' tables of 2022-02-25 (3D topology "
            "benchmarks for BLOOM)"
        ),
        "url": "https://github.com/bigscience-workshop/bigscience/blob/master/train/tr11-176B-ml/chronicles-prequel.md",
        "hardware": "Jean Zay: 48 nodes x 8 A100 80GB (NVLink), 4 x 100 Gb/s Omni-Path per node (6.25 GB/s per GPU)",
        "measured": (
            "seconds per iteration at iteration 2 (a single snapshot; the table's note says figures fluctuate a bit)"
        ),
        "settings": (
            "Megatron-DeepSpeed GPT: NHIDDEN 14336, NLAYERS 72, NHEADS 64, vocab 250k (250880 padded), sequence "
            "2048, fp16, ZeRO-1, full activation checkpointing, DeepSpeed 1F1B pipeline, tied embeddings on the "
            "first and last stage, non-flash attention"
        ),
        "step_time": "as published",
    },
    "mosaicml_llm_foundry": {
        "title": (
            "MosaicML llm-foundry, scripts/train/benchmarking/README.md, MPT training benchmark tables (H100 80GB"
            " BF16, A100 80GB, A100 40GB)"
        ),
        "url": "https://github.com/mosaicml/llm-foundry/blob/main/scripts/train/benchmarking/README.md",
        "hardware": (
            "MosaicML platform: 8 GPUs per node; A100 clusters with 1600 Gbps (8 x 200 Gb/s RoCE) per node; H100 "
            "interconnect not stated (400 Gb/s per GPU assumed)"
        ),
        "measured": "throughput in tokens/s of the whole job",
        "settings": (
            "MPT (GPT-shaped: no biases, ALiBi, vocab 50368, d_ff = 4 d_model), triton flash attention, FSDP "
            "FULL_SHARD (ZeRO-3 over all GPUs), bf16, micro-batch and gradient accumulation as listed, activation"
            " checkpointing True = full; rows with sequence <= 8192 kept; priced with cluster.kernels eager:"
            " llm-foundry trains PyTorch modules under Composer with torch.autocast (precision amp_bf16) and gradient"
            " clipping, one kernel per op, none of Megatron's fused kernels"
        ),
        "step_time": "step_time_s = GlobalBatchSize(T) / Throughput(T/s)",
    },
    "meshrun_h100": {
        "title": "meshrun bench/measure_device.py on one H100 SXM5 80GB (torch 2.11, CUDA 13.0), 2026-11-24",
        "url": "bench/measure_device.py (this repository); raw output tests/service/data/h100_measured.json",
        "hardware": "one NVIDIA H100 80GB HBM3, 132 SMs",
        "measured": "median seconds per training step (after 3 warm-up steps), peak allocated and reserved bytes",
        "settings": (
            "GPT-2 shaped model (as meshrun's workers: separate q/k/v projections, biases, untied head), eager "
            "PyTorch, bf16 autocast over fp32 weights, SDPA (flash) attention, fused AdamW, vocab 50304, sequence"
            " 2048, one GPU; recompute = torch.utils.checkpoint per block"
        ),
        "step_time": "as measured",
    },
}

runs = []


def add(**kw):
    runs.append(kw)


# ---- Narayanan 2021 Table 1 -------------------------------------------------------------------------
NAR = [  # params(B), heads, hidden, layers, t, p, GPUs, batch, TFLOP/s per GPU, % of peak, aggregate PFLOP/s
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137, 44, 4.4),
    (3.6, 32, 3072, 30, 2, 1, 64, 512, 138, 44, 8.8),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142, 46, 18.2),
    (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135, 43, 34.6),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138, 44, 70.8),
    (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140, 45, 143.8),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148, 47, 227.1),
    (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155, 50, 297.4),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163, 52, 410.2),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163, 52, 502.0),
]
SC21_MICRO_BATCH = (16, 16, 16, 8, 4, 2, 2, 1, 1, 1)  # Megatron-LM examples/sc21/run_table_1.sh, row by row
for (size, a, h, L, t, p, n, B, tf, pct, agg), mb in zip(NAR, SC21_MICRO_BATCH, strict=True):
    s, V = 2048, 51200
    flops = 96 * B * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h))
    add(
        id=f"narayanan2021-{size}B",
        source="narayanan2021",
        group=None,
        model=dict(n_layers=L, d_model=h, n_heads=a, vocab_size=V, seq_len=s),
        cluster=dict(device="A100-80GB", gpus_per_node=8, nodes=n // 8),
        layout=dict(dp=n // (t * p), tp=t, pp=p),
        micro_batch_size=mb,
        global_batch_size=B,
        precision="fp16",
        activation_checkpointing="full",
        flash_attention=False,
        published=dict(tflops_per_gpu=tf, percent_of_peak=pct, aggregate_pflops=agg),
        step_time_s=flops / (n * tf * 1e12),
    )

# ---- Korthikanti 2022 ------------------------------------------------------------------------------------
KOR = [  # name, heads, hidden, layers, t, p, GPUs, batch, full-recompute s/it, present-work s/it
    ("22B", 64, 6144, 48, 8, 1, 8, 4, 1.42, 1.10),
    ("175B", 96, 12288, 96, 8, 8, 64, 64, 18.13, 13.75),
    ("530B", 128, 20480, 105, 8, 35, 280, 280, 49.05, 37.83),
    ("1T", 160, 25600, 128, 8, 64, 512, 512, 94.42, 71.49),
]
for name, a, h, L, t, p, n, B, full, present in KOR:
    base = dict(
        source="korthikanti2022",
        group=None,
        model=dict(n_layers=L, d_model=h, n_heads=a, vocab_size=51200, seq_len=2048),
        cluster=dict(device="A100-80GB", gpus_per_node=8, nodes=max(1, n // 8)),
        micro_batch_size=1,
        global_batch_size=B,
        precision="fp16",
        flash_attention=False,
    )
    add(
        id=f"korthikanti2022-{name}-full",
        layout=dict(dp=1, tp=t, pp=p),
        activation_checkpointing="full",
        published=dict(seconds_per_iteration=full),
        step_time_s=full,
        **base,
    )
    add(
        id=f"korthikanti2022-{name}-sp-selective",
        layout=dict(dp=1, tp=t, pp=p, sequence_parallel=True),
        activation_checkpointing="selective",
        published=dict(seconds_per_iteration=present),
        step_time_s=present,
        **base,
    )

# ---- BigScience tr11 prequel, 2022-02-25 -------------------------------------------------------------------
BS = [  # DP, TP, PP, MBS, GBS, Mem (GB or None), Sec/it
    (8, 8, 6, 4, 1568, 56, 113.01),
    (8, 8, 6, 4, 2048, 55, 114.11),
    (8, 8, 6, 6, 2016, 66, 123.57),
    (4, 8, 12, 4, 1568, None, 92.75),
    (4, 8, 12, 4, 2048, 49, 117.07),
    (4, 8, 12, 2, 1568, None, 99.93),
    (4, 8, 12, 2, 2048, None, 128.82),
    (6, 8, 8, 4, 2016, 52, 113.16),
    (12, 8, 4, 2, 2016, 53, 125.52),
    (12, 8, 4, 4, 2016, 59, 114.81),
    (24, 8, 2, 1, 2016, 65, 145.45),
    (24, 8, 2, 2, 2016, 76, 136.13),
    (8, 4, 12, 4, 2048, 60, 111.89),
    (8, 4, 12, 2, 2048, 44, 110.48),
    (16, 4, 6, 4, 2048, 75, 117.11),
    (16, 4, 6, 2, 2048, 57, 111.71),
    (16, 2, 12, 2, 2048, 63, 112.50),
    (8, 2, 24, 1, 2048, 44, 119.53),
    (8, 2, 24, 2, 2048, 53, 122.75),
    (4, 4, 24, 1, 2048, None, 130.60),
]
for dp, t, p, mb, gbs, mem, sec in BS:
    if (dp * mb) and gbs % (dp * mb):
        continue
    add(
        id=f"bigscience_tr11-dp{dp}-tp{t}-pp{p}-mb{mb}-gbs{gbs}",
        source="bigscience_tr11",
        group="bigscience_tr11-181B-384xA100",
        model=dict(n_layers=72, d_model=14336, n_heads=64, vocab_size=250880, seq_len=2048),
        cluster=dict(device="A100-80GB", gpus_per_node=8, nodes=48, inter_node_bandwidth_bytes_per_s=5.6e9),
        layout=dict(dp=dp, tp=t, pp=p, zero_stage=1),
        micro_batch_size=mb,
        global_batch_size=gbs,
        precision="fp16",
        activation_checkpointing="full",
        flash_attention=False,
        published=dict(seconds_per_iteration=sec, max_memory_gb=mem),
        step_time_s=sec,
        note="DeepSpeed ZeRO-1 with tp/pp (no meshrun layout; the planner prices it with validate=False)",
    )

# ---- MosaicML llm-foundry ---------------------------------------------------------------------------------
MPT = {
    "125m": (12, 768, 12),
    "350m": (24, 1024, 16),
    "760m": (24, 1536, 12),
    "1b": (24, 2048, 16),
    "3b": (32, 2560, 20),
    "7b": (32, 4096, 32),
    "13b": (40, 5120, 40),
    "30b": (48, 7168, 56),
    "70b": (80, 8192, 64),
}
# model, seq, GPUs, MFU, mb, GA, GBS(seq), tokens/s, GBS tokens, act ckpt
H100 = [
    ("70b", 2048, 64, 42.57, 8, 4, 2048, 66523, 4194304, True),
    ("70b", 2048, 32, 36.15, 2, 16, 1024, 28242, 2097152, True),
    ("30b", 8192, 8, 29.92, 1, 21, 168, 11072, 1376256, True),
    ("30b", 4096, 8, 35.86, 1, 21, 168, 14419, 688128, True),
    ("30b", 2048, 32, 43.92, 14, 3, 1344, 73860, 2752512, True),
    ("30b", 2048, 16, 43.07, 10, 3, 480, 36209, 983040, True),
    ("30b", 2048, 8, 38.11, 3, 21, 504, 16022, 1032192, True),
    ("30b", 1024, 8, 38.76, 6, 21, 1008, 16672, 1032192, True),
    ("13b", 4096, 8, 41.6, 10, 3, 240, 37740, 983040, True),
    ("13b", 2048, 64, 39.86, 2, 1, 128, 307209, 262144, False),
    ("13b", 2048, 32, 39.95, 2, 1, 64, 153960, 131072, False),
    ("13b", 2048, 16, 39.58, 2, 1, 32, 76280, 65536, False),
    ("13b", 2048, 8, 39.79, 2, 1, 16, 38336, 32768, False),
    ("13b", 1024, 8, 44.27, 40, 3, 960, 44019, 983040, True),
    ("7b", 8192, 8, 37.14, 8, 2, 128, 55481, 1048576, True),
    ("7b", 4096, 8, 40.42, 16, 2, 256, 68893, 1048576, True),
    ("7b", 2048, 8, 46.44, 6, 1, 48, 85144, 98304, False),
    ("7b", 1024, 8, 42.83, 64, 2, 1024, 81628, 1048576, True),
    ("3b", 8192, 8, 40.31, 3, 6, 144, 132626, 1179648, False),
    ("3b", 4096, 8, 42.31, 5, 6, 240, 167712, 983040, False),
    ("3b", 2048, 64, 40.8, 6, 3, 1152, 1441663, 2359296, False),
    ("3b", 2048, 32, 41.7, 6, 3, 576, 736701, 1179648, False),
    ("3b", 2048, 16, 43.73, 10, 3, 480, 386285, 983040, False),
    ("3b", 1024, 8, 46.2, 20, 6, 960, 216369, 983040, False),
    ("3b", 512, 8, 46.32, 40, 6, 1920, 223721, 983040, False),
    ("1b", 8192, 8, 37.73, 3, 4, 96, 233256, 786432, False),
    ("1b", 4096, 8, 40.26, 7, 4, 224, 308282, 917504, False),
    ("1b", 2048, 64, 40.85, 20, 1, 1280, 2841754, 2621440, False),
    ("1b", 2048, 32, 41.52, 20, 1, 640, 1444183, 1310720, False),
    ("1b", 2048, 16, 42.36, 20, 1, 320, 736596, 655360, False),
    ("1b", 2048, 8, 41.82, 14, 1, 112, 363645, 229376, False),
    ("1b", 1024, 8, 41.95, 18, 4, 576, 391287, 589824, False),
    ("1b", 512, 8, 43.21, 56, 4, 1792, 418201, 917504, False),
    ("760m", 8192, 8, 34.84, 6, 2, 96, 334602, 786432, False),
    ("760m", 4096, 8, 35.83, 12, 2, 192, 443674, 786432, False),
    ("760m", 2048, 32, 37.57, 24, 1, 768, 2175091, 1572864, False),
    ("760m", 2048, 16, 37.89, 24, 1, 384, 1096819, 786432, False),
    ("760m", 2048, 8, 34.9, 24, 2, 384, 505177, 786432, False),
    ("760m", 1024, 8, 39.76, 48, 2, 768, 628648, 786432, False),
    ("760m", 512, 8, 40.42, 96, 2, 1536, 669998, 786432, False),
]
A100_80 = [
    ("70b", 2048, 64, 53.33, 8, 4, 2048, 26274, 4194304, True),
    ("70b", 2048, 32, 48.56, 2, 16, 1024, 11962, 2097152, True),
    ("30b", 8192, 8, 39.38, 1, 21, 168, 4594, 1376256, True),
    ("30b", 4096, 8, 51.37, 1, 21, 168, 6513, 688128, True),
    ("30b", 2048, 8, 55.3, 3, 21, 504, 7330, 1032192, True),
    ("30b", 1024, 8, 55.82, 6, 21, 1008, 7571, 1032192, True),
    ("30b", 512, 8, 56.4, 12, 21, 2016, 7739, 1032192, True),
    ("13b", 8192, 8, 56.07, 5, 3, 120, 14362, 983040, True),
    ("13b", 4096, 8, 57.62, 10, 3, 240, 16482, 983040, True),
    ("13b", 2048, 8, 59.57, 2, 3, 48, 18097, 98304, False),
    ("13b", 1024, 8, 59.48, 40, 3, 960, 18647, 983040, True),
    ("7b", 8192, 8, 54.47, 8, 2, 128, 25655, 1048576, True),
    ("7b", 4096, 8, 54.84, 16, 2, 256, 29472, 1048576, True),
    ("7b", 2048, 8, 64.23, 6, 2, 96, 37130, 196608, False),
    ("7b", 1024, 8, 58.01, 64, 2, 1024, 34857, 1048576, True),
    ("3b", 8192, 8, 59.34, 3, 6, 144, 61567, 1179648, False),
    ("3b", 4096, 8, 60.53, 5, 6, 240, 75658, 983040, False),
    ("3b", 2048, 8, 62.11, 10, 2, 160, 86491, 327680, False),
    ("3b", 1024, 8, 62.73, 20, 6, 960, 92643, 983040, False),
    ("3b", 512, 8, 63.71, 40, 6, 1920, 97019, 983040, False),
    ("1b", 8192, 8, 56.69, 3, 4, 96, 110516, 786432, False),
    ("1b", 4096, 8, 59.0, 7, 4, 224, 142457, 917504, False),
    ("1b", 2048, 8, 59.86, 14, 4, 448, 164109, 917504, False),
    ("1b", 1024, 8, 60.15, 18, 4, 576, 176898, 589824, False),
    ("1b", 512, 8, 60.68, 56, 4, 1792, 185186, 917504, False),
    ("760m", 8192, 8, 55.31, 6, 2, 96, 167471, 786432, False),
    ("760m", 4096, 8, 56.05, 12, 2, 192, 218808, 786432, False),
    ("760m", 2048, 8, 56.85, 24, 2, 384, 259472, 786432, False),
    ("760m", 1024, 8, 47.76, 48, 2, 768, 238122, 786432, False),
    ("760m", 512, 8, 45.07, 96, 2, 1536, 235571, 786432, False),
    ("350m", 8192, 8, 53.8, 8, 2, 128, 292559, 1048576, False),
    ("350m", 4096, 8, 53.31, 16, 2, 256, 396442, 1048576, False),
    ("350m", 2048, 8, 51.62, 32, 2, 512, 470263, 1048576, False),
    ("350m", 1024, 8, 50.51, 64, 2, 1024, 518504, 1048576, False),
    ("350m", 512, 8, 50.61, 128, 2, 2048, 554643, 1048576, False),
    ("125m", 8192, 8, 48.85, 8, 2, 128, 723142, 1048576, False),
    ("125m", 4096, 8, 46.08, 16, 2, 256, 947172, 1048576, False),
    ("125m", 2048, 8, 44.79, 40, 2, 640, 1142641, 1310720, False),
    ("125m", 2048, 8, 44.45, 32, 2, 512, 1133901, 1048576, False),
    ("125m", 1024, 8, 43.15, 64, 2, 1024, 1251751, 1048576, False),
    ("125m", 512, 8, 42.56, 128, 2, 2048, 1325455, 1048576, False),
]
A100_40 = [
    ("70b", 2048, 128, 48.91, 4, 1, 512, 48194, 1048576, True),
    ("70b", 2048, 64, 35.87, 2, 1, 128, 17672, 262144, True),
    ("30b", 2048, 128, 52.25, 6, 1, 768, 110803, 1572864, True),
    ("30b", 2048, 32, 51.74, 4, 1, 128, 27431, 262144, True),
    ("13b", 8192, 8, 43.95, 1, 16, 128, 11258, 1048576, True),
    ("13b", 4096, 8, 44.85, 2, 16, 256, 12830, 1048576, True),
    ("13b", 2048, 128, 51.93, 16, 1, 2048, 252444, 4194304, True),
    ("13b", 2048, 64, 52.04, 16, 1, 1024, 126479, 2097152, True),
    ("13b", 2048, 32, 52.62, 14, 1, 448, 63946, 917504, True),
    ("13b", 2048, 16, 52.5, 10, 1, 160, 31900, 327680, True),
    ("13b", 2048, 8, 43.94, 4, 16, 512, 13347, 1048576, True),
    ("13b", 1024, 8, 44.07, 8, 16, 1024, 13817, 1048576, True),
    ("13b", 512, 8, 44.28, 16, 16, 2048, 14108, 1048576, True),
    ("7b", 8192, 8, 49.04, 3, 4, 96, 23098, 786432, True),
    ("7b", 4096, 8, 50.11, 6, 4, 192, 26930, 786432, True),
    ("7b", 2048, 128, 50.14, 18, 1, 2304, 463749, 4718592, True),
    ("7b", 2048, 64, 50.73, 18, 1, 1152, 234614, 2359296, True),
    ("7b", 2048, 32, 51.55, 18, 1, 576, 119202, 1179648, True),
    ("7b", 2048, 16, 50.44, 16, 1, 256, 58322, 524288, True),
    ("7b", 2048, 8, 50.92, 12, 4, 384, 29436, 786432, True),
    ("7b", 1024, 8, 51.31, 24, 4, 768, 30833, 786432, True),
    ("7b", 512, 8, 50.85, 48, 4, 1536, 31167, 786432, True),
    ("3b", 8192, 8, 55.13, 1, 8, 64, 57193, 524288, False),
    ("3b", 4096, 8, 56.18, 2, 8, 128, 70223, 524288, False),
    ("3b", 2048, 128, 54.8, 6, 1, 768, 1220885, 1572864, False),
    ("3b", 2048, 64, 55.94, 6, 1, 384, 623167, 786432, False),
    ("3b", 2048, 32, 56.96, 6, 1, 192, 317261, 393216, False),
    ("3b", 2048, 16, 56.02, 5, 1, 80, 156013, 163840, False),
    ("3b", 2048, 8, 57.82, 5, 8, 320, 80520, 655360, False),
    ("3b", 1024, 8, 58.14, 10, 8, 640, 85854, 655360, False),
    ("3b", 512, 8, 59.49, 20, 8, 1280, 90596, 655360, False),
    ("1b", 8192, 8, 55.29, 2, 8, 128, 107799, 1048576, False),
    ("1b", 4096, 8, 55.85, 4, 8, 256, 134851, 1048576, False),
    ("1b", 2048, 128, 54.41, 10, 1, 1280, 2386897, 2621440, False),
    ("1b", 2048, 64, 55.44, 10, 1, 640, 1216104, 1310720, False),
    ("1b", 2048, 32, 45.39, 10, 1, 320, 497782, 655360, False),
    ("1b", 2048, 16, 55.69, 8, 1, 128, 305372, 262144, False),
    ("1b", 2048, 8, 56.23, 8, 8, 512, 154171, 1048576, False),
    ("1b", 1024, 8, 57.02, 16, 8, 1024, 167677, 1048576, False),
    ("1b", 512, 8, 57.1, 32, 8, 2048, 174256, 1048576, False),
    ("760m", 8192, 8, 53.12, 3, 4, 96, 160853, 786432, False),
    ("760m", 4096, 8, 53.0, 6, 4, 192, 206909, 786432, False),
    ("760m", 2048, 128, 50.73, 12, 1, 1536, 3704382, 3145728, False),
    ("760m", 2048, 64, 51.44, 12, 1, 768, 1878030, 1572864, False),
    ("760m", 2048, 32, 51.97, 12, 1, 384, 948745, 786432, False),
    ("760m", 2048, 16, 51.9, 12, 1, 192, 473723, 393216, False),
    ("760m", 2048, 8, 52.89, 12, 4, 384, 241389, 786432, False),
    ("760m", 1024, 8, 53.63, 24, 4, 768, 267376, 786432, False),
    ("760m", 512, 8, 53.47, 48, 4, 1536, 279504, 786432, False),
    ("350m", 8192, 8, 51.39, 4, 4, 128, 279466, 1048576, False),
    ("350m", 4096, 8, 50.38, 8, 4, 256, 374670, 1048576, False),
    ("350m", 2048, 128, 45.61, 18, 1, 2304, 6647647, 4718592, False),
    ("350m", 2048, 64, 46.27, 18, 1, 1152, 3372118, 2359296, False),
    ("350m", 2048, 32, 47.26, 18, 1, 576, 1721978, 1179648, False),
    ("350m", 2048, 16, 48.66, 18, 1, 288, 886622, 589824, False),
    ("350m", 2048, 8, 49.17, 16, 4, 512, 447963, 1048576, False),
    ("350m", 1024, 8, 48.73, 32, 4, 1024, 500184, 1048576, False),
    ("350m", 512, 8, 48.39, 64, 4, 2048, 530277, 1048576, False),
    ("125m", 8192, 8, 46.94, 5, 3, 120, 694868, 983040, False),
    ("125m", 4096, 8, 44.82, 13, 3, 312, 921297, 1277952, False),
    ("125m", 2048, 128, 38.86, 26, 1, 3328, 15863837, 6815744, False),
    ("125m", 2048, 64, 39.27, 26, 1, 1664, 8015010, 3407872, False),
    ("125m", 2048, 32, 39.86, 26, 1, 832, 4067922, 1703936, False),
    ("125m", 2048, 16, 40.93, 26, 1, 416, 2088560, 851968, False),
    ("125m", 2048, 8, 42.75, 26, 3, 624, 1090678, 1277952, False),
    ("125m", 1024, 8, 40.89, 52, 3, 1248, 1186314, 1277952, False),
    ("125m", 512, 8, 40.26, 104, 3, 2496, 1253886, 1277952, False),
]
for device, table in (("H100", H100), ("A100-80GB", A100_80), ("A100-40GB", A100_40)):
    for name, s, n, mfu, mb, ga, gbs, tps, gbs_tok, ckpt in table:
        L, h, a = MPT[name]
        assert gbs * s == gbs_tok, (name, s, n)
        if gbs != mb * ga * n:
            continue
        add(
            id=f"mosaicml-{device}-{name}-s{s}-n{n}-mb{mb}",
            source="mosaicml_llm_foundry",
            group=f"mosaicml-{device}-{name}-s{s}-n{n}",
            model=dict(n_layers=L, d_model=h, n_heads=a, vocab_size=50368, seq_len=s),
            cluster=dict(device=device, gpus_per_node=8, nodes=n // 8),
            layout=dict(dp=n, zero_stage=3),
            micro_batch_size=mb,
            global_batch_size=gbs,
            precision="bf16",
            activation_checkpointing="full" if ckpt else "none",
            flash_attention=True,
            kernels="eager",
            published=dict(mfu_percent=mfu, tokens_per_s=tps, global_batch_tokens=gbs_tok, grad_accum=ga),
            step_time_s=gbs_tok / tps,
        )

# ---- meshrun's own H100 measurements (bench/measure_device.py) ----------------------------------------------
measured = json.loads((HERE / "h100_measured.json").read_text())
for r in measured["gpt"]:
    if r.get("oom"):
        continue
    rec = "full" if r["recompute"] else "none"
    add(
        id=f"meshrun_h100-{r['model']}-mb{r['micro_batch']}-{rec}",
        source="meshrun_h100",
        group=f"meshrun_h100-{r['model']}",
        model=dict(
            n_layers=r["n_layers"],
            d_model=r["d_model"],
            n_heads=r["n_heads"],
            vocab_size=r["vocab"],
            seq_len=r["seq_len"],
        ),
        cluster=dict(device="H100", gpus_per_node=1, nodes=1),
        layout=dict(),
        micro_batch_size=r["micro_batch"],
        global_batch_size=r["micro_batch"],
        precision="bf16",
        activation_checkpointing=rec,
        flash_attention=True,
        published=dict(
            step_s=r["step_s"],
            peak_allocated_bytes=r["peak_allocated_bytes"],
            peak_reserved_bytes=r["peak_reserved_bytes"],
            n_params=r["n_params"],
        ),
        step_time_s=r["step_s"],
    )

if __name__ == "__main__":
    (HERE / "published_runs.json").write_text(json.dumps({"sources": SOURCES, "runs": runs}, indent=1))
    print(len(runs), dict(Counter(r["source"] for r in runs)))
