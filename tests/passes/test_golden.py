"""Golden graphs of the KVPP passes (regenerate with EXPECTTEST_ACCEPT=1 and review the diff)."""

import expecttest
import torch

from kvpp_fx.backend import kvpp_backend
from kvpp_fx.passes.render import normalize_code
from kvpp_fx.schedule import LayerSchedule
from kvpp_fx.runtime.runtime import KVPPRuntime
from tests.passes import toy
from tests.support.specs import TOY_SPECS


def compile_and_run(model, backend, plan, num_layers, with_drafts=()):
    storage = toy.allocate(plan)
    # targets get handles (the pass rebinds them); draft layers keep their real, local cache
    caches = toy.runtime_caches(storage, range(num_layers)) + [storage.typed_views(i)["kv"] for i in with_drafts]
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    with KVPPRuntime.create(plan, storage) as rt, rt.forward(has_history=False):
        compiled(*toy.step_inputs(0, 3, 3)[:1], caches, *toy.step_inputs(0, 3, 3)[1:])
    return backend.records[-1]


class TestGoldenGraphs(expecttest.TestCase):
    def test_insert_pass_eager(self):
        plan = toy.toy_plan(2)
        backend = kvpp_backend(plan, mode="eager", specs=TOY_SPECS)
        record = compile_and_run(toy.ToyMLA(2), backend, plan, 2)
        self.assertExpectedInline(normalize_code(record.graph_after), """\
def forward(self, L_x_, self.layers.0.kv_a.weight, self.layers.0.q.weight, L_caches_0_, L_slot_mapping_, L_block_table_, L_seq_lens_, L_query_lens_, self.layers.0.o.weight, self.layers.1.kv_a.weight, self.layers.1.q.weight, L_caches_1_, self.layers.1.o.weight):
    kvpp_prefetch_L0 = torch.ops.kvpp.prefetch.default(0, 0)
    h = torch.tanh(l_x_)
    linear = torch._C._nn.linear(h, self.layers.0.kv_a.weight, None)
    split = linear.split([8, 4], dim = -1)
    kv_c = split[0]
    k_pe = split[1]
    linear_1 = torch._C._nn.linear(h, self.layers.0.q.weight, None)
    view = linear_1.view(-1, 2, 12)
    split_1 = view.split([8, 4], dim = -1)
    q_latent = split_1[0]
    q_pe = split_1[1]
    kvpp_wait_L0 = torch.ops.kvpp.wait.default(0, 0, [l_caches_0_], ['kv'], tables = [l_slot_mapping_, l_block_table_], table_kinds = ['slot_mapping', 'block_table'], routed = True)
    kv_L0 = kvpp_wait_L0[0]
    l_slot_mapping_L0 = kvpp_wait_L0[1]
    l_block_table_L0 = kvpp_wait_L0[2]
    kvpp_prefetch_L1 = torch.ops.kvpp.prefetch.default(1, 1)
    write_kv = kvpp_fx_runtime_graph_ops_routed_owner_kvpp_ref_write_kv_L0(kv_L0, kv_c, k_pe, l_slot_mapping_L0, 0)
    attn = kvpp_fx_runtime_graph_ops_routed_heads_kvpp_ref_mla_attention_L0(q_latent, q_pe, kv_L0, l_block_table_L0, l_seq_lens_, l_query_lens_, 0.5, 0)
    flatten = attn.flatten(1)
    linear_2 = torch._C._nn.linear(flatten, self.layers.0.o.weight, None)
    x = l_x_ + linear_2
    h_1 = torch.tanh(x)
    linear_3 = torch._C._nn.linear(h_1, self.layers.1.kv_a.weight, None)
    split_2 = linear_3.split([8, 4], dim = -1)
    kv_c_1 = split_2[0]
    k_pe_1 = split_2[1]
    linear_4 = torch._C._nn.linear(h_1, self.layers.1.q.weight, None)
    view_1 = linear_4.view(-1, 2, 12)
    split_3 = view_1.split([8, 4], dim = -1)
    q_latent_1 = split_3[0]
    q_pe_1 = split_3[1]
    kvpp_wait_L1 = torch.ops.kvpp.wait.default(1, 1, [l_caches_1_], ['kv'], tables = [l_slot_mapping_, l_block_table_], table_kinds = ['slot_mapping', 'block_table'], routed = True)
    kv_L1 = kvpp_wait_L1[0]
    l_slot_mapping_L1 = kvpp_wait_L1[1]
    l_block_table_L1 = kvpp_wait_L1[2]
    write_kv_1 = kvpp_fx_runtime_graph_ops_routed_owner_kvpp_ref_write_kv_L1(kv_L1, kv_c_1, k_pe_1, l_slot_mapping_L1, 1)
    attn_1 = kvpp_fx_runtime_graph_ops_routed_heads_kvpp_ref_mla_attention_L1(q_latent_1, q_pe_1, kv_L1, l_block_table_L1, l_seq_lens_, l_query_lens_, 0.5, 1)
    flatten_1 = attn_1.flatten(1)
    linear_5 = torch._C._nn.linear(flatten_1, self.layers.1.o.weight, None)
    x_1 = x + linear_5
    return (x_1,)""")

    def test_piecewise_pieces(self):
        plan = toy.toy_plan(2)
        backend = kvpp_backend(plan, mode="piecewise", inner="eager", specs=TOY_SPECS)
        record = compile_and_run(toy.ToyMLA(2), backend, plan, 2)
        self.assertExpectedInline(record.piece_summary, """\
submod_0 [eager]: kvpp.prefetch(0, 0)
submod_1 [compiled]: tanh, linear, .split, linear, .view, .split
submod_2 [eager]: kvpp.wait(0, 0, [l_caches_0_], ['kv'], tables=[l_slot_mapping_, l_block_table_], table_kinds=['slot_mapping', 'block_table'], routed=True); kvpp.prefetch(1, 1); routed[owner] kvpp_ref.write_kv(getitem, kv_c, k_pe, getitem_1, 0); routed[heads 0@1,1@1->@1] kvpp_ref.mla_attention(q_latent, q_pe, getitem, getitem_2, l_seq_lens_, l_query_lens_, 0.5, 0)
submod_3 [compiled]: .flatten, linear, add, tanh, linear, .split, linear, .view, .split
submod_4 [eager]: kvpp.wait(1, 1, [l_caches_1_], ['kv'], tables=[l_slot_mapping_, l_block_table_], table_kinds=['slot_mapping', 'block_table'], routed=True); routed[owner] kvpp_ref.write_kv(getitem, kv_c_1, k_pe_1, getitem_1, 1); routed[heads 0@1,1@1->@1] kvpp_ref.mla_attention(q_latent_1, q_pe_1, getitem, getitem_2, l_seq_lens_, l_query_lens_, 0.5, 1)
submod_5 [compiled]: .flatten, linear, add""")

    def test_draft_layer_gets_no_nodes(self):
        plan = toy.toy_plan(2, drafts=1)
        backend = kvpp_backend(plan, mode="eager", specs=TOY_SPECS)
        record = compile_and_run(toy.ToyMLA(3), backend, plan, 2, with_drafts=(2,))
        self.assertExpectedInline(normalize_code(record.graph_after), """\
def forward(self, L_x_, self.layers.0.kv_a.weight, self.layers.0.q.weight, L_caches_0_, L_slot_mapping_, L_block_table_, L_seq_lens_, L_query_lens_, self.layers.0.o.weight, self.layers.1.kv_a.weight, self.layers.1.q.weight, L_caches_1_, self.layers.1.o.weight, self.layers.2.kv_a.weight, self.layers.2.q.weight, L_caches_2_, self.layers.2.o.weight):
    kvpp_prefetch_L0 = torch.ops.kvpp.prefetch.default(0, 0)
    h = torch.tanh(l_x_)
    linear = torch._C._nn.linear(h, self.layers.0.kv_a.weight, None)
    split = linear.split([8, 4], dim = -1)
    kv_c = split[0]
    k_pe = split[1]
    linear_1 = torch._C._nn.linear(h, self.layers.0.q.weight, None)
    view = linear_1.view(-1, 2, 12)
    split_1 = view.split([8, 4], dim = -1)
    q_latent = split_1[0]
    q_pe = split_1[1]
    kvpp_wait_L0 = torch.ops.kvpp.wait.default(0, 0, [l_caches_0_], ['kv'], tables = [l_slot_mapping_, l_block_table_], table_kinds = ['slot_mapping', 'block_table'], routed = True)
    kv_L0 = kvpp_wait_L0[0]
    l_slot_mapping_L0 = kvpp_wait_L0[1]
    l_block_table_L0 = kvpp_wait_L0[2]
    kvpp_prefetch_L1 = torch.ops.kvpp.prefetch.default(1, 1)
    write_kv = kvpp_fx_runtime_graph_ops_routed_owner_kvpp_ref_write_kv_L0(kv_L0, kv_c, k_pe, l_slot_mapping_L0, 0)
    attn = kvpp_fx_runtime_graph_ops_routed_heads_kvpp_ref_mla_attention_L0(q_latent, q_pe, kv_L0, l_block_table_L0, l_seq_lens_, l_query_lens_, 0.5, 0)
    flatten = attn.flatten(1)
    linear_2 = torch._C._nn.linear(flatten, self.layers.0.o.weight, None)
    x = l_x_ + linear_2
    h_1 = torch.tanh(x)
    linear_3 = torch._C._nn.linear(h_1, self.layers.1.kv_a.weight, None)
    split_2 = linear_3.split([8, 4], dim = -1)
    kv_c_1 = split_2[0]
    k_pe_1 = split_2[1]
    linear_4 = torch._C._nn.linear(h_1, self.layers.1.q.weight, None)
    view_1 = linear_4.view(-1, 2, 12)
    split_3 = view_1.split([8, 4], dim = -1)
    q_latent_1 = split_3[0]
    q_pe_1 = split_3[1]
    kvpp_wait_L1 = torch.ops.kvpp.wait.default(1, 1, [l_caches_1_], ['kv'], tables = [l_slot_mapping_, l_block_table_], table_kinds = ['slot_mapping', 'block_table'], routed = True)
    kv_L1 = kvpp_wait_L1[0]
    l_slot_mapping_L1 = kvpp_wait_L1[1]
    l_block_table_L1 = kvpp_wait_L1[2]
    write_kv_1 = kvpp_fx_runtime_graph_ops_routed_owner_kvpp_ref_write_kv_L1(kv_L1, kv_c_1, k_pe_1, l_slot_mapping_L1, 1)
    attn_1 = kvpp_fx_runtime_graph_ops_routed_heads_kvpp_ref_mla_attention_L1(q_latent_1, q_pe_1, kv_L1, l_block_table_L1, l_seq_lens_, l_query_lens_, 0.5, 1)
    flatten_1 = attn_1.flatten(1)
    linear_5 = torch._C._nn.linear(flatten_1, self.layers.1.o.weight, None)
    x_1 = x + linear_5
    h_2 = torch.tanh(x_1)
    linear_6 = torch._C._nn.linear(h_2, self.layers.2.kv_a.weight, None)
    split_4 = linear_6.split([8, 4], dim = -1)
    kv_c_2 = split_4[0]
    k_pe_2 = split_4[1]
    linear_7 = torch._C._nn.linear(h_2, self.layers.2.q.weight, None)
    view_2 = linear_7.view(-1, 2, 12)
    split_5 = view_2.split([8, 4], dim = -1)
    q_latent_2 = split_5[0]
    q_pe_2 = split_5[1]
    write_kv_2 = torch.ops.kvpp_ref.write_kv(l_caches_2_, kv_c_2, k_pe_2, l_slot_mapping_, 2)
    attn_2 = torch.ops.kvpp_ref.mla_attention(q_latent_2, q_pe_2, l_caches_2_, l_block_table_, l_seq_lens_, l_query_lens_, 0.5, 2)
    flatten_2 = attn_2.flatten(1)
    linear_8 = torch._C._nn.linear(flatten_2, self.layers.2.o.weight, None)
    x_2 = x_1 + linear_8
    return (x_2,)""")

    def test_vllm_style_layer_name(self):
        # Four layers, where the other goldens take two: layer 2 reuses slot 0, prefetched only after layer 0's
        # attention has read it.
        names = {f"model.layers.{i}.self_attn.attn": i for i in range(4)}
        table = LayerSchedule(target_layers=(0, 1, 2, 3), names=names)
        backend = kvpp_backend(table, mode="eager", specs=TOY_SPECS)
        plan = toy.toy_plan(4)
        storage = toy.allocate(plan)
        for name, i in names.items():
            toy.VLLM_STYLE_CACHES[name] = storage.typed_views(i)["kv"]
        torch._dynamo.reset()
        compiled = torch.compile(toy.ToyVLLMStyle(4), backend=backend, fullgraph=True)
        with KVPPRuntime.create(plan, storage) as rt, rt.forward(has_history=False):
            compiled(torch.randn(3, toy.HIDDEN))
        self.assertExpectedInline(normalize_code(backend.records[-1].graph_after), """\
def forward(self, self.proj.0.weight, L_x_, self.proj.1.weight, self.proj.2.weight, self.proj.3.weight):
    kvpp_prefetch_L0 = torch.ops.kvpp.prefetch.default(0, 0)
    linear = torch._C._nn.linear(l_x_, self.proj.0.weight, None)
    kvpp_wait_L0 = torch.ops.kvpp.wait.default(0, 0, [], [])
    kvpp_prefetch_L1 = torch.ops.kvpp.prefetch.default(1, 1)
    unified_attention = torch.ops.toy_vllm.unified_attention(linear, 'model.layers.0.self_attn.attn')
    x = l_x_ + unified_attention
    linear_1 = torch._C._nn.linear(x, self.proj.1.weight, None)
    kvpp_wait_L1 = torch.ops.kvpp.wait.default(1, 1, [], [])
    kvpp_prefetch_L2 = torch.ops.kvpp.prefetch.default(2, 0)
    unified_attention_1 = torch.ops.toy_vllm.unified_attention(linear_1, 'model.layers.1.self_attn.attn')
    x_1 = x + unified_attention_1
    linear_2 = torch._C._nn.linear(x_1, self.proj.2.weight, None)
    kvpp_wait_L2 = torch.ops.kvpp.wait.default(2, 0, [], [])
    kvpp_prefetch_L3 = torch.ops.kvpp.prefetch.default(3, 1)
    unified_attention_2 = torch.ops.toy_vllm.unified_attention(linear_2, 'model.layers.2.self_attn.attn')
    x_2 = x_1 + unified_attention_2
    linear_3 = torch._C._nn.linear(x_2, self.proj.3.weight, None)
    kvpp_wait_L3 = torch.ops.kvpp.wait.default(3, 1, [], [])
    unified_attention_3 = torch.ops.toy_vllm.unified_attention(linear_3, 'model.layers.3.self_attn.attn')
    x_3 = x_2 + unified_attention_3
    return (x_3,)""")
