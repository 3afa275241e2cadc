"""Packed documents through the model, as Megatron-LM's loop calls it: `pretrain_gpt.
forward_step` hands the model `packed_seq_params` (THD) built from its data set's
`cu_seqlens` (GPTDataset with `--dataloader-inter-document-masking`, SFTDataset: the packed
row shifted by one as a whole). Two documents that meet digit-to-digit ("... 1 2" + "3 4 ...")
packed into one row must give exactly what the same documents give as separate rows: loss,
statistics and every parameter's gradient.

megatron's THD attention is Transformer Engine's (GPU only); on CPU this file gives the tiny
model a core attention that reads `packed_seq_params` (block-diagonal causal SDPA, a test
stand-in for TE's kernel), while megatron's own THD code around it runs as it is (the
[t, 1, h] squeeze and reshape, RoPE restarted per document by `_apply_rotary_pos_emb_thd`).
The separate rows are the same documents as a [2, s] batch with plain causal attention; the
loss on them is the single-device reference on the documents' label sequences.

Until NumericLossGPTModel reads packed documents (issue 51, "What to build" 3) it refuses
them (`_refuse_packed`), and this test fails with that refusal."""

from __future__ import annotations

import pytest
import torch

from del_megatron import DigitVocab, NumericLossConfig, numeric_loss
from del_megatron.models import LlamaArchitecture, megatron_lm
from tests.utils import assert_close

pytestmark = pytest.mark.megatron

VOCAB = DigitVocab(digit_ids=list(range(10, 20)), point_ids=[20], vocab_size=100)
LOSS = NumericLossConfig(kind="del", normalize="tokens")
ARCH = LlamaArchitecture(
    vocab_size=100,
    hidden_size=32,
    ffn_hidden_size=64,
    num_layers=2,
    num_attention_heads=4,
    num_query_groups=2,
    max_position_embeddings=32,
    rope_theta=500000.0,
    qkv_bias=True,
    tie_word_embeddings=True,
)
WORDS = [30, 41, 52, 63, 74, 85]


def digit(value: int) -> int:
    return 10 + value


# two documents meeting digit-to-digit: "w w 1 2" + "3 4 . 5 w 6 7 w"
FIRST = [WORDS[0], WORDS[1], digit(1), digit(2)]
SECOND = [digit(3), digit(4), 20, digit(5), WORDS[2], digit(6), digit(7), WORDS[3]]


def packed_core_attention():
    from del_megatron.models.attention import SDPACoreAttention

    class PackedSDPACoreAttention(SDPACoreAttention):
        """SDPACoreAttention that also reads megatron's THD format: query [t, heads, d],
        key/value [t, groups, d] (megatron squeezed the batch of one), each position
        attending causally within its own document only -> [t, heads * d]."""

        def forward(self, query, key, value, attention_mask, *args, packed_seq_params=None, **kw):
            if packed_seq_params is None:
                return super().forward(query, key, value, attention_mask, *args, **kw)
            offsets = packed_seq_params.cu_seqlens_q_padded
            if offsets is None:
                offsets = packed_seq_params.cu_seqlens_q
            t = query.shape[0]
            position = torch.arange(t)
            document = torch.bucketize(position, offsets[1:].long(), right=True)
            allowed = (document[:, None] == document[None, :]) & (
                position[:, None] >= position[None, :]
            )
            repeat = self.heads_per_partition // self.groups_per_partition
            key = key.repeat_interleave(repeat, dim=1)
            value = value.repeat_interleave(repeat, dim=1)
            q, k, v = (x.permute(1, 0, 2).unsqueeze(0) for x in (query, key, value))
            context = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=allowed, scale=self.scale
            )  # [1, heads, t, d]
            return context[0].permute(1, 0, 2).reshape(t, -1)

    return PackedSDPACoreAttention


def builder(args, pre_process, post_process, vp_stage=None, config=None, pg_collection=None):
    """Megatron-LM's gpt_builder, on CPU, with the THD-reading core attention."""
    from megatron.core.models.gpt import GPTModel

    from del_megatron.models.spec import apply_device_shims, gpt_layer_spec

    cpu = torch.device("cpu")
    spec = gpt_layer_spec(cpu)
    spec.submodules.self_attention.submodules.core_attention = packed_core_attention()
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=True,
        position_embedding_type="rope",
        rotary_base=args.rotary_base,
        vp_stage=vp_stage,
        pg_collection=pg_collection,
    )
    return apply_device_shims(model, cpu)


class Args:
    padded_vocab_size = ARCH.padded_vocab_size(1)
    max_position_embeddings = ARCH.max_position_embeddings
    rotary_base = ARCH.rope_theta


@pytest.fixture
def model(one_process_groups):
    from del_megatron.models.llama import transformer_config

    torch.manual_seed(0)
    config = transformer_config(ARCH, torch.device("cpu"), calculate_per_token_loss=True)
    numeric = megatron_lm.numeric_builder(builder, VOCAB, LOSS)
    return numeric(Args(), True, True, config=config)


def megatron_lm_packed_batch():
    """As Megatron-LM's GPTDataset packs with inter-document masking: the row of s + 1
    tokens, tokens = row[:-1], labels = row[1:], positions restarting per document,
    cu_seqlens over the s tokens (the extra token folded into the last document);
    pretrain_gpt.forward_step's PackedSeqParams."""
    from megatron.core.packed_seq_params import PackedSeqParams

    row = torch.tensor([FIRST + SECOND])
    tokens, labels = row[:, :-1], row[:, 1:].contiguous()
    lengths = [len(FIRST), len(SECOND) - 1]
    positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    cu = torch.tensor([0, lengths[0], sum(lengths)], dtype=torch.int32)
    params = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        max_seqlen_q=max(lengths),
        max_seqlen_kv=max(lengths),
    )
    return tokens, labels, positions, params


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_a_packed_row_through_the_model_equals_its_documents_as_rows(model):
    tokens, labels, positions, params = megatron_lm_packed_batch()
    mask = torch.ones(labels.shape)

    # the documents as rows: tokens [FIRST] and [SECOND without its last token], plain causal
    width = max(len(FIRST), len(SECOND) - 1)
    rows = torch.full((2, width), WORDS[5])
    rows[0, : len(FIRST)] = torch.tensor(FIRST)
    rows[1, : len(SECOND) - 1] = torch.tensor(SECOND[:-1])
    row_positions = torch.arange(width).expand(2, width)
    model.zero_grad()
    logits = model(rows, row_positions, None)  # [2, s, V]: megatron's own path, no labels
    packed_order = torch.cat([logits[0, : len(FIRST)], logits[1, : len(SECOND) - 1]])
    # the targets of each document: the second's begin with its first token, predicted at
    # the first's last position (labels are the row shifted as a whole)
    split = [len(FIRST) - 1, len(SECOND)]
    label_rows = torch.full((2, max(split)), -100)
    logit_rows = packed_order.new_zeros(2, max(split), packed_order.shape[-1])
    for i, part in enumerate(labels[0].split(split)):
        label_rows[i, : len(part)] = part
    for i, part in enumerate(packed_order.split(split)):
        logit_rows[i, : len(part)] = part
    mask_rows = (label_rows != -100).float()
    expected = numeric_loss(logit_rows, label_rows, VOCAB, LOSS, mask_rows)
    joined = numeric_loss(packed_order.detach().unsqueeze(0), labels, VOCAB, LOSS, mask)
    assert abs(joined.numeric.item() - expected.numeric.item()) > 1e-3  # "1 2 3 4" vs two
    expected.loss.backward()
    expected_grads = grads(model)

    model.zero_grad()
    packed = model(tokens, positions, None, labels=labels, loss_mask=mask, packed_seq_params=params)
    packed.loss.backward()
    for name in ("loss", "ce", "numeric"):
        assert_close(getattr(packed, name), getattr(expected, name), atol=2e-6, what=name)
    for key in expected.stats:
        assert_close(packed.stats[key], expected.stats[key], atol=1e-4, what=f"stats {key}")
    packed_grads = grads(model)
    assert packed_grads.keys() == expected_grads.keys()
    for name, grad in expected_grads.items():
        assert_close(packed_grads[name], grad, atol=2e-6, what=f"grad {name}")
