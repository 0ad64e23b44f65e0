"""probjax-eqx: fast, exact model components for JAX as Equinox modules."""

from probjax_eqx import biases as biases
from probjax_eqx import masks as masks
from probjax_eqx import sharding as sharding
from probjax_eqx.attention import ISAB as ISAB
from probjax_eqx.attention import MAB as MAB
from probjax_eqx.attention import PMA as PMA
from probjax_eqx.attention import SAB as SAB
from probjax_eqx.attention import Attention as Attention
from probjax_eqx.attention import KVCache as KVCache
from probjax_eqx.attention import dot_product_attention as dot_product_attention
from probjax_eqx.attention import explain_attention as explain_attention
from probjax_eqx.attention import flex_attention as flex_attention
from probjax_eqx.attention_call import AttentionCall as AttentionCall
from probjax_eqx.backends import Backend as Backend
from probjax_eqx.backends import Choice as Choice
from probjax_eqx.backends import UnsupportedError as UnsupportedError
from probjax_eqx.backends import detect_device as detect_device
from probjax_eqx.backends import explain as explain
from probjax_eqx.backends import resolve as resolve
from probjax_eqx.dit import DiffusionTransformer as DiffusionTransformer
from probjax_eqx.expert_parallel import expert_parallel_moe as expert_parallel_moe
from probjax_eqx.expert_parallel import expert_parallel_moe_shard as expert_parallel_moe_shard
from probjax_eqx.expert_parallel import expert_parallel_specs as expert_parallel_specs
from probjax_eqx.mamba import Mamba as Mamba
from probjax_eqx.mamba import Mamba2 as Mamba2
from probjax_eqx.mamba import selective_scan as selective_scan
from probjax_eqx.mla import MLA as MLA
from probjax_eqx.moe import MoE as MoE
from probjax_eqx.moe import MoEAux as MoEAux
from probjax_eqx.moe import grouped_matmul as grouped_matmul
from probjax_eqx.ring_attention import context_parallel_attention as context_parallel_attention
from probjax_eqx.ring_attention import ring_attention as ring_attention
from probjax_eqx.ring_attention import zigzag_permutation as zigzag_permutation
from probjax_eqx.rla import RLA as RLA

__version__ = "0.1.0"
