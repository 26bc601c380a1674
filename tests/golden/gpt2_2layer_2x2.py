


def forward(self, mesh_coord, input_ids, labels):
    transformer_wpe_weight_dtensor = self.transformer.wpe.weight
    transformer_wpe_weight = autoparallel_runtime_kernels_autograd_param_local(transformer_wpe_weight_dtensor);  transformer_wpe_weight_dtensor = None
    transformer_h_0_ln_1_weight_dtensor = getattr(self.transformer.h, "0").ln_1.weight
    transformer_h_0_ln_1_weight = autoparallel_runtime_kernels_autograd_param_local(transformer_h_0_ln_1_weight_dtensor);  transformer_h_0_ln_1_weight_dtensor = None
    transformer_h_0_ln_1_bias_dtensor = getattr(self.transformer.h, "0").ln_1.bias
    transformer_h_0_ln_1_bias = autoparallel_runtime_kernels_autograd_param_local(transformer_h_0_ln_1_bias_dtensor);  transformer_h_0_ln_1_bias_dtensor = None
    transformer_h_0_attn_c_attn_weight_dtensor = getattr(self.transformer.h, "0").attn.c_attn.weight
    transformer_h_0_attn_c_attn_weight = autoparallel_runtime_kernels_autograd_param_local(transformer_h_0_attn_c_attn_weight_dtensor);  transformer_h_0_attn_c_attn_weight_dtensor = None
    transformer_h_0_attn_c_attn_bias_dtensor = getattr(self.transformer.h, "0").attn.c_attn.bias
    transformer_h_0_attn_c_attn_bias = autoparallel_runtime_kernels_autograd_param_local(transformer_h_0_attn_c_attn_bias_dtensor);  transformer_h_0_attn_c_attn_bias_dtensor = None
    transformer_h_0_attn_c_proj_weight_dtensor = getattr(self.transformer.h, "0").attn.c_proj.weight
    transformer_h_0_attn_c_proj_weight = autoparallel_runtime_kernels_autograd_param_local(transformer_h_0_attn_c_proj_weight_dtensor);  transformer_h_0_attn_c_proj_weight_dtensor = None
    transformer_h_0_attn_c_proj_bias_dtensor = getattr(self.transformer.h, "0").attn.c_proj.bias
    transformer_h_0_attn_c_proj_bias = autoparallel_runtime_kernels_autograd_param_local(transformer_h_0_attn_c_proj_bias_dtensor);  transformer_h_0_attn_c_proj_bias_dtensor = None
    transformer_h_0_ln_2_weight_dtensor = getattr(self.transformer.h, "0").ln_2.weight
    transformer_h_0_ln_2_weight = autoparallel_runtime_kernels_autograd_param_local(transformer_h_0_ln_2_weight_dtensor);  transformer_h_0_ln_2_weight_dtensor = None
    transformer_h_0_ln_2_bias_dtensor = getattr(self.transformer.h, "0").ln_2.bias
    transformer_h_0_ln_2_bias = autoparallel_runtime_kernels_autograd_param_local(transformer_h_0_ln_2_bias_dtensor);  transformer_h_0_ln_2_bias_dtensor = None
    transformer_h_0_mlp_c_fc_weight_dtensor = getattr(self.transformer.h, "0").mlp.c_fc.weight
    transformer_h_0_mlp_c_fc_weight = autoparallel_runtime_kernels_autograd_param_local(transformer_h_0_mlp_c_fc_weight_dtensor);  transformer_h_0_mlp_c_fc_weight_dtensor = None
    transformer_h_0_mlp_c_fc_bias_dtensor = getattr(self.transformer.h, "0").mlp.c_fc.bias
    transformer_h_0_mlp_c_fc_bias = autoparallel_runtime_kernels_autograd_param_local(transformer_h_0_mlp_c_fc_bias_dtensor);  transformer_h_0_mlp_c_fc_bias_dtensor = None
    transformer_h_0_mlp_c_proj_weight_dtensor = getattr(self.transformer.h, "0").mlp.c_proj.weight
    transformer_h_0_mlp_c_proj_weight = autoparallel_runtime_kernels_autograd_param_local(transformer_h_0_mlp_c_proj_weight_dtensor);  transformer_h_0_mlp_c_proj_weight_dtensor = None
    transformer_h_0_mlp_c_proj_bias_dtensor = getattr(self.transformer.h, "0").mlp.c_proj.bias
    transformer_h_0_mlp_c_proj_bias = autoparallel_runtime_kernels_autograd_param_local(transformer_h_0_mlp_c_proj_bias_dtensor);  transformer_h_0_mlp_c_proj_bias_dtensor = None
    transformer_h_1_ln_1_weight_dtensor = getattr(self.transformer.h, "1").ln_1.weight
    transformer_h_1_ln_1_weight = autoparallel_runtime_kernels_autograd_param_local(transformer_h_1_ln_1_weight_dtensor);  transformer_h_1_ln_1_weight_dtensor = None
    transformer_h_1_ln_1_bias_dtensor = getattr(self.transformer.h, "1").ln_1.bias
    transformer_h_1_ln_1_bias = autoparallel_runtime_kernels_autograd_param_local(transformer_h_1_ln_1_bias_dtensor);  transformer_h_1_ln_1_bias_dtensor = None
    transformer_h_1_attn_c_attn_weight_dtensor = getattr(self.transformer.h, "1").attn.c_attn.weight
    transformer_h_1_attn_c_attn_weight = autoparallel_runtime_kernels_autograd_param_local(transformer_h_1_attn_c_attn_weight_dtensor);  transformer_h_1_attn_c_attn_weight_dtensor = None
    transformer_h_1_attn_c_attn_bias_dtensor = getattr(self.transformer.h, "1").attn.c_attn.bias
    transformer_h_1_attn_c_attn_bias = autoparallel_runtime_kernels_autograd_param_local(transformer_h_1_attn_c_attn_bias_dtensor);  transformer_h_1_attn_c_attn_bias_dtensor = None
    transformer_h_1_attn_c_proj_weight_dtensor = getattr(self.transformer.h, "1").attn.c_proj.weight
    transformer_h_1_attn_c_proj_weight = autoparallel_runtime_kernels_autograd_param_local(transformer_h_1_attn_c_proj_weight_dtensor);  transformer_h_1_attn_c_proj_weight_dtensor = None
    transformer_h_1_attn_c_proj_bias_dtensor = getattr(self.transformer.h, "1").attn.c_proj.bias
    transformer_h_1_attn_c_proj_bias = autoparallel_runtime_kernels_autograd_param_local(transformer_h_1_attn_c_proj_bias_dtensor);  transformer_h_1_attn_c_proj_bias_dtensor = None
    transformer_h_1_ln_2_weight_dtensor = getattr(self.transformer.h, "1").ln_2.weight
    transformer_h_1_ln_2_weight = autoparallel_runtime_kernels_autograd_param_local(transformer_h_1_ln_2_weight_dtensor);  transformer_h_1_ln_2_weight_dtensor = None
    transformer_h_1_ln_2_bias_dtensor = getattr(self.transformer.h, "1").ln_2.bias
    transformer_h_1_ln_2_bias = autoparallel_runtime_kernels_autograd_param_local(transformer_h_1_ln_2_bias_dtensor);  transformer_h_1_ln_2_bias_dtensor = None
    transformer_h_1_mlp_c_fc_weight_dtensor = getattr(self.transformer.h, "1").mlp.c_fc.weight
    transformer_h_1_mlp_c_fc_weight = autoparallel_runtime_kernels_autograd_param_local(transformer_h_1_mlp_c_fc_weight_dtensor);  transformer_h_1_mlp_c_fc_weight_dtensor = None
    transformer_h_1_mlp_c_fc_bias_dtensor = getattr(self.transformer.h, "1").mlp.c_fc.bias
    transformer_h_1_mlp_c_fc_bias = autoparallel_runtime_kernels_autograd_param_local(transformer_h_1_mlp_c_fc_bias_dtensor);  transformer_h_1_mlp_c_fc_bias_dtensor = None
    transformer_h_1_mlp_c_proj_weight_dtensor = getattr(self.transformer.h, "1").mlp.c_proj.weight
    transformer_h_1_mlp_c_proj_weight = autoparallel_runtime_kernels_autograd_param_local(transformer_h_1_mlp_c_proj_weight_dtensor);  transformer_h_1_mlp_c_proj_weight_dtensor = None
    transformer_h_1_mlp_c_proj_bias_dtensor = getattr(self.transformer.h, "1").mlp.c_proj.bias
    transformer_h_1_mlp_c_proj_bias = autoparallel_runtime_kernels_autograd_param_local(transformer_h_1_mlp_c_proj_bias_dtensor);  transformer_h_1_mlp_c_proj_bias_dtensor = None
    transformer_ln_f_weight_dtensor = self.transformer.ln_f.weight
    transformer_ln_f_weight = autoparallel_runtime_kernels_autograd_param_local(transformer_ln_f_weight_dtensor);  transformer_ln_f_weight_dtensor = None
    transformer_ln_f_bias_dtensor = self.transformer.ln_f.bias
    transformer_ln_f_bias = autoparallel_runtime_kernels_autograd_param_local(transformer_ln_f_bias_dtensor);  transformer_ln_f_bias_dtensor = None
    transformer_wte_weight_1_dtensor = self.transformer.wte.weight
    transformer_wte_weight_1 = autoparallel_runtime_kernels_autograd_param_local(transformer_wte_weight_1_dtensor);  transformer_wte_weight_1_dtensor = None
    view = torch.ops.aten.view.default(input_ids, [8, 16]);  input_ids = None
    # transformer.wte: S1(dp) S0(tp), R R -> S2(dp) P(tp)
    coord_tp = torch.ops.aten.slice.Tensor(mesh_coord, 0, 1, 2);  mesh_coord = None
    mul = torch.ops.aten.mul.Tensor(coord_tp, 64)
    sub_1 = torch.ops.aten.sub.Tensor(view, mul);  view = mul = None
    ge = torch.ops.aten.ge.Scalar(sub_1, 0)
    lt = torch.ops.aten.lt.Scalar(sub_1, 64)
    logical_and = torch.ops.aten.logical_and.default(ge, lt);  ge = lt = None
    where = torch.ops.aten.where.ScalarOther(logical_and, sub_1, 0);  sub_1 = None
    embedding_2 = torch.ops.aten.embedding.default(transformer_wte_weight_1, where);  where = None
    unsqueeze_4 = torch.ops.aten.unsqueeze.default(logical_and, -1);  logical_and = None
    embedding = torch.ops.aten.where.ScalarOther(unsqueeze_4, embedding_2, 0.0);  unsqueeze_4 = embedding_2 = None
    arange = torch.ops.aten.arange.default(16, device = device(type='cpu'), pin_memory = False)
    add = torch.ops.aten.add.Tensor(arange, 0);  arange = None
    unsqueeze = torch.ops.aten.unsqueeze.default(add, 0);  add = None
    # transformer.wpe: S1(dp) S0(tp), R R -> S2(dp) P(tp)
    mul_1 = torch.ops.aten.mul.Tensor(coord_tp, 16)
    sub_2 = torch.ops.aten.sub.Tensor(unsqueeze, mul_1);  unsqueeze = mul_1 = None
    ge_1 = torch.ops.aten.ge.Scalar(sub_2, 0)
    lt_1 = torch.ops.aten.lt.Scalar(sub_2, 16)
    logical_and_1 = torch.ops.aten.logical_and.default(ge_1, lt_1);  ge_1 = lt_1 = None
    where_1 = torch.ops.aten.where.ScalarOther(logical_and_1, sub_2, 0);  sub_2 = None
    embedding_3 = torch.ops.aten.embedding.default(transformer_wpe_weight, where_1);  transformer_wpe_weight = where_1 = None
    unsqueeze_5 = torch.ops.aten.unsqueeze.default(logical_and_1, -1);  logical_and_1 = None
    embedding_1 = torch.ops.aten.where.ScalarOther(unsqueeze_5, embedding_3, 0.0);  unsqueeze_5 = embedding_3 = None
    to = torch.ops.aten.to.dtype_layout(embedding_1, dtype = torch.float32, layout = torch.strided, device = device(type='cpu'));  embedding_1 = None
    add_1 = torch.ops.aten.add.Tensor(embedding, to);  embedding = to = None
    # transformer.drop: redistribute add_1 S2(dp) P(tp) -> S2(dp) R
    contiguous_1 = torch.ops.aten.contiguous.default(add_1);  add_1 = None
    all_reduce = torch.ops._c10d_functional.all_reduce.default(contiguous_1, 'sum', Group.tp);  contiguous_1 = None
    add_1_s2dp_r = torch.ops._c10d_functional.wait_tensor.default(all_reduce);  all_reduce = None
    dropout = torch.ops.aten.dropout.default(add_1_s2dp_r, 0.0, True);  add_1_s2dp_r = None
    # transformer.h.0.ln_1: redistribute dropout S2(dp) R -> S0(dp) S0(tp)
    contiguous_2 = torch.ops.aten.contiguous.default(dropout)
    all_to_all_single = torch.ops._c10d_functional.all_to_all_single.default(contiguous_2, [4, 4], [4, 4], Group.dp);  contiguous_2 = None
    wait_tensor = torch.ops._c10d_functional.wait_tensor.default(all_to_all_single);  all_to_all_single = None
    unflatten = torch.ops.aten.unflatten.int(wait_tensor, 0, [2, 4]);  wait_tensor = None
    movedim = torch.ops.aten.movedim.int(unflatten, 0, 2);  unflatten = None
    flatten = torch.ops.aten.flatten.using_ints(movedim, 2, 3);  movedim = None
    dropout_s0dp_s0tp = autoparallel_runtime_kernels_autograd_local_piece(flatten, 0, 2, coord_tp);  flatten = None
    # transformer.h.0.ln_1: redistribute transformer_h_0_ln_1_weight S0(dp) S0(tp) -> R R
    contiguous_3 = torch.ops.aten.contiguous.default(transformer_h_0_ln_1_weight);  transformer_h_0_ln_1_weight = None
    all_gather_into_tensor = torch.ops._c10d_functional.all_gather_into_tensor.default(contiguous_3, 2, Group.tp);  contiguous_3 = None
    wait_tensor_1 = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor);  all_gather_into_tensor = None
    all_gather_into_tensor_1 = torch.ops._c10d_functional.all_gather_into_tensor.default(wait_tensor_1, 2, Group.dp);  wait_tensor_1 = None
    # transformer.h.0.ln_1: redistribute transformer_h_0_ln_1_bias S0(dp) S0(tp) -> R R
    contiguous_4 = torch.ops.aten.contiguous.default(transformer_h_0_ln_1_bias);  transformer_h_0_ln_1_bias = None
    all_gather_into_tensor_2 = torch.ops._c10d_functional.all_gather_into_tensor.default(contiguous_4, 2, Group.tp);  contiguous_4 = None
    wait_tensor_2 = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor_2);  all_gather_into_tensor_2 = None
    all_gather_into_tensor_3 = torch.ops._c10d_functional.all_gather_into_tensor.default(wait_tensor_2, 2, Group.dp);  wait_tensor_2 = None
    transformer_h_0_ln_1_weight_replicated = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor_1);  all_gather_into_tensor_1 = None
    transformer_h_0_ln_1_bias_replicated = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor_3);  all_gather_into_tensor_3 = None
    # transformer.h.0.attn.c_attn: redistribute transformer_h_0_attn_c_attn_bias S0(dp) S0(tp) -> R R
    contiguous_5 = torch.ops.aten.contiguous.default(transformer_h_0_attn_c_attn_bias);  transformer_h_0_attn_c_attn_bias = None
    all_gather_into_tensor_4 = torch.ops._c10d_functional.all_gather_into_tensor.default(contiguous_5, 2, Group.tp);  contiguous_5 = None
    layer_norm = torch.ops.aten.layer_norm.default(dropout_s0dp_s0tp, [64], transformer_h_0_ln_1_weight_replicated, transformer_h_0_ln_1_bias_replicated, 1e-05, False);  dropout_s0dp_s0tp = transformer_h_0_ln_1_weight_replicated = transformer_h_0_ln_1_bias_replicated = None
    # transformer.h.0.attn.c_attn: S0(dp) S0(tp) -> S0(dp) S0(tp)
    view_1 = torch.ops.aten.view.default(layer_norm, [32, 64]);  layer_norm = None
    wait_tensor_3 = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor_4);  all_gather_into_tensor_4 = None
    all_gather_into_tensor_5 = torch.ops._c10d_functional.all_gather_into_tensor.default(wait_tensor_3, 2, Group.dp);  wait_tensor_3 = None
    transformer_h_0_attn_c_attn_bias_replicated = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor_5);  all_gather_into_tensor_5 = None
    slice_tensor_1 = torch.ops.aten.slice.Tensor(transformer_h_0_attn_c_attn_weight, 1, 0, 64)
    # transformer.h.0.attn.c_attn: redistribute slice_tensor_1 S0(dp) S0(tp) -> R R
    contiguous_6 = torch.ops.aten.contiguous.default(slice_tensor_1);  slice_tensor_1 = None
    all_gather_into_tensor_6 = torch.ops._c10d_functional.all_gather_into_tensor.default(contiguous_6, 2, Group.tp);  contiguous_6 = None
    slice_tensor = torch.ops.aten.slice.Tensor(transformer_h_0_attn_c_attn_bias_replicated, 0, 0, 64)
    wait_tensor_4 = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor_6);  all_gather_into_tensor_6 = None
    all_gather_into_tensor_7 = torch.ops._c10d_functional.all_gather_into_tensor.default(wait_tensor_4, 2, Group.dp);  wait_tensor_4 = None
    slice_tensor_1_replicated = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor_7);  all_gather_into_tensor_7 = None
    slice_tensor_3 = torch.ops.aten.slice.Tensor(transformer_h_0_attn_c_attn_weight, 1, 64, 128)
    # transformer.h.0.attn.c_attn: redistribute slice_tensor_3 S0(dp) S0(tp) -> R R
    contiguous_7 = torch.ops.aten.contiguous.default(slice_tensor_3);  slice_tensor_3 = None
    all_gather_into_tensor_8 = torch.ops._c10d_functional.all_gather_into_tensor.default(contiguous_7, 2, Group.tp);  contiguous_7 = None
    addmm_default = torch.ops.aten.addmm.default(slice_tensor, view_1, slice_tensor_1_replicated);  slice_tensor = slice_tensor_1_replicated = None
    # transformer.h.0.attn.c_attn: S0(dp) S0(tp) -> S0(dp) S0(tp)
    view_default = torch.ops.aten.view.default(addmm_default, [2, 16, 64]);  addmm_default = None
    slice_tensor_2 = torch.ops.aten.slice.Tensor(transformer_h_0_attn_c_attn_bias_replicated, 0, 64, 128)
    wait_tensor_5 = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor_8);  all_gather_into_tensor_8 = None
    all_gather_into_tensor_9 = torch.ops._c10d_functional.all_gather_into_tensor.default(wait_tensor_5, 2, Group.dp);  wait_tensor_5 = None
    slice_tensor_3_replicated = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor_9);  all_gather_into_tensor_9 = None
    slice_tensor_5 = torch.ops.aten.slice.Tensor(transformer_h_0_attn_c_attn_weight, 1, 128, 192);  transformer_h_0_attn_c_attn_weight = None
    # transformer.h.0.attn.c_attn: redistribute slice_tensor_5 S0(dp) S0(tp) -> R R
    contiguous_8 = torch.ops.aten.contiguous.default(slice_tensor_5);  slice_tensor_5 = None
    all_gather_into_tensor_10 = torch.ops._c10d_functional.all_gather_into_tensor.default(contiguous_8, 2, Group.tp);  contiguous_8 = None
    addmm_default_1 = torch.ops.aten.addmm.default(slice_tensor_2, view_1, slice_tensor_3_replicated);  slice_tensor_2 = slice_tensor_3_replicated = None
    # transformer.h.0.attn.c_attn: S0(dp) S0(tp) -> S0(dp) S0(tp)
    view_default_1 = torch.ops.aten.view.default(addmm_default_1, [2, 16, 64]);  addmm_default_1 = None
    slice_tensor_4 = torch.ops.aten.slice.Tensor(transformer_h_0_attn_c_attn_bias_replicated, 0, 128, 192);  transformer_h_0_attn_c_attn_bias_replicated = None
    wait_tensor_6 = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor_10);  all_gather_into_tensor_10 = None
    all_gather_into_tensor_11 = torch.ops._c10d_functional.all_gather_into_tensor.default(wait_tensor_6, 2, Group.dp);  wait_tensor_6 = None
    slice_tensor_5_replicated = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor_11);  all_gather_into_tensor_11 = None
    # transformer.h.0.ln_2: redistribute transformer_h_0_ln_2_weight S0(dp) S0(tp) -> R R
    contiguous_11 = torch.ops.aten.contiguous.default(transformer_h_0_ln_2_weight);  transformer_h_0_ln_2_weight = None
    all_gather_into_tensor_16 = torch.ops._c10d_functional.all_gather_into_tensor.default(contiguous_11, 2, Group.tp);  contiguous_11 = None
    addmm_default_2 = torch.ops.aten.addmm.default(slice_tensor_4, view_1, slice_tensor_5_replicated);  slice_tensor_4 = view_1 = slice_tensor_5_replicated = None
    # transformer.h.0.attn.c_attn: S0(dp) S0(tp) -> S0(dp) S0(tp)
    view_default_2 = torch.ops.aten.view.default(addmm_default_2, [2, 16, 64]);  addmm_default_2 = None
    # transformer.h.0.attn: S0(dp) S0(tp) -> S0(dp) S0(tp)
    view_3 = torch.ops.aten.view.default(view_default_1, [2, 16, 4, 16]);  view_default_1 = None
    transpose = torch.ops.aten.transpose.int(view_3, 1, 2);  view_3 = None
    # transformer.h.0.attn: S0(dp) S0(tp) -> S0(dp) S0(tp)
    view_4 = torch.ops.aten.view.default(view_default_2, [2, 16, 4, 16]);  view_default_2 = None
    transpose_1 = torch.ops.aten.transpose.int(view_4, 1, 2);  view_4 = None
    # transformer.h.0.attn: S0(dp) S0(tp) -> S0(dp) S0(tp)
    view_5 = torch.ops.aten.view.default(view_default, [2, 16, 4, 16]);  view_default = None
    transpose_2 = torch.ops.aten.transpose.int(view_5, 1, 2);  view_5 = None
    scaled_dot_product_attention = torch.ops.aten.scaled_dot_product_attention.default(transpose_2, transpose, transpose_1, None, scale = 0.25, is_causal = True);  transpose_2 = transpose = transpose_1 = None
    # transformer.h.0.attn: S0(dp) S0(tp) -> S0(dp) S0(tp)
    reshape = torch.ops.aten.reshape.default(scaled_dot_product_attention, [2, 4, 16, 16]);  scaled_dot_product_attention = None
    transpose_3 = torch.ops.aten.transpose.int(reshape, 1, 2);  reshape = None
    # transformer.h.0.attn: S0(dp) S0(tp) -> S0(dp) S0(tp)
    reshape_1 = torch.ops.aten.reshape.default(transpose_3, [2, 16, 64]);  transpose_3 = None
    # transformer.h.0.attn.c_proj: S0(dp) S0(tp) -> S0(dp) S0(tp)
    view_6 = torch.ops.aten.view.default(reshape_1, [32, 64]);  reshape_1 = None
    # transformer.h.0.attn.c_proj: redistribute view_6 S0(dp) S0(tp) -> R R
    contiguous_9 = torch.ops.aten.contiguous.default(view_6);  view_6 = None
    all_gather_into_tensor_12 = torch.ops._c10d_functional.all_gather_into_tensor.default(contiguous_9, 2, Group.tp);  contiguous_9 = None
    wait_tensor_7 = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor_12);  all_gather_into_tensor_12 = None
    all_gather_into_tensor_13 = torch.ops._c10d_functional.all_gather_into_tensor.default(wait_tensor_7, 2, Group.dp);  wait_tensor_7 = None
    view_6_replicated = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor_13);  all_gather_into_tensor_13 = None
    addmm_1 = torch.ops.aten.addmm.default(transformer_h_0_attn_c_proj_bias, view_6_replicated, transformer_h_0_attn_c_proj_weight);  transformer_h_0_attn_c_proj_bias = view_6_replicated = transformer_h_0_attn_c_proj_weight = None
    # transformer.h.0.attn.c_proj: S1(dp) S1(tp) -> S2(dp) S2(tp)
    view_7 = torch.ops.aten.view.default(addmm_1, [8, 16, 16]);  addmm_1 = None
    dropout_1 = torch.ops.aten.dropout.default(view_7, 0.0, True);  view_7 = None
    # transformer.h.0: redistribute dropout S2(dp) R -> S2(dp) S2(tp)
    dropout_s2dp_s2tp = autoparallel_runtime_kernels_autograd_local_piece(dropout, 2, 2, coord_tp);  dropout = None
    add_4 = torch.ops.aten.add.Tensor(dropout_1, dropout_s2dp_s2tp);  dropout_1 = dropout_s2dp_s2tp = None
    # transformer.h.0.ln_2: redistribute add_4 S2(dp) S2(tp) -> R R
    contiguous_10 = torch.ops.aten.contiguous.default(add_4)
    all_gather_into_tensor_14 = torch.ops._c10d_functional.all_gather_into_tensor.default(contiguous_10, 2, Group.tp);  contiguous_10 = None
    wait_tensor_8 = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor_14);  all_gather_into_tensor_14 = None
    all_gather_into_tensor_15 = torch.ops._c10d_functional.all_gather_into_tensor.default(wait_tensor_8, 2, Group.dp);  wait_tensor_8 = None
    wait_tensor_9 = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor_15);  all_gather_into_tensor_15 = None
    unflatten_1 = torch.ops.aten.unflatten.int(wait_tensor_9, 0, [4, 8]);  wait_tensor_9 = None
    movedim_1 = torch.ops.aten.movedim.int(unflatten_1, 0, 2);  unflatten_1 = None
    add_4_replicated = torch.ops.aten.flatten.using_ints(movedim_1, 2, 3);  movedim_1 = None
    wait_tensor_10 = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor_16);  all_gather_into_tensor_16 = None
    all_gather_into_tensor_17 = torch.ops._c10d_functional.all_gather_into_tensor.default(wait_tensor_10, 2, Group.dp);  wait_tensor_10 = None
    # transformer.h.0.ln_2: redistribute transformer_h_0_ln_2_bias S0(dp) S0(tp) -> R R
    contiguous_12 = torch.ops.aten.contiguous.default(transformer_h_0_ln_2_bias);  transformer_h_0_ln_2_bias = None
    all_gather_into_tensor_18 = torch.ops._c10d_functional.all_gather_into_tensor.default(contiguous_12, 2, Group.tp);  contiguous_12 = None
    wait_tensor_11 = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor_18);  all_gather_into_tensor_18 = None
    all_gather_into_tensor_19 = torch.ops._c10d_functional.all_gather_into_tensor.default(wait_tensor_11, 2, Group.dp);  wait_tensor_11 = None
    transformer_h_0_ln_2_weight_replicated = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor_17);  all_gather_into_tensor_17 = None
    transformer_h_0_ln_2_bias_replicated = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor_19);  all_gather_into_tensor_19 = None
    # transformer.h.1.ln_1: redistribute transformer_h_1_ln_1_weight S0(dp) S0(tp) -> R R
    contiguous_16 = torch.ops.aten.contiguous.default(transformer_h_1_ln_1_weight);  transformer_h_1_ln_1_weight = None
    all_gather_into_tensor_23 = torch.ops._c10d_functional.all_gather_into_tensor.default(contiguous_16, 2, Group.tp);  contiguous_16 = None
    layer_norm_1 = torch.ops.aten.layer_norm.default(add_4_replicated, [64], transformer_h_0_ln_2_weight_replicated, transformer_h_0_ln_2_bias_replicated, 1e-05, False);  add_4_replicated = transformer_h_0_ln_2_weight_replicated = transformer_h_0_ln_2_bias_replicated = None
    view_8 = torch.ops.aten.view.default(layer_norm_1, [128, 64]);  layer_norm_1 = None
    addmm_2 = torch.ops.aten.addmm.default(transformer_h_0_mlp_c_fc_bias, view_8, transformer_h_0_mlp_c_fc_weight);  transformer_h_0_mlp_c_fc_bias = view_8 = transformer_h_0_mlp_c_fc_weight = None
    # transformer.h.0.mlp.c_fc: S1(dp) S1(tp) -> S2(dp) S2(tp)
    view_9 = torch.ops.aten.view.default(addmm_2, [8, 16, 64]);  addmm_2 = None
    gelu_default = torch.ops.aten.gelu.default(view_9, approximate = 'tanh');  view_9 = None
    # transformer.h.0.mlp.c_proj: S2(dp) S2(tp) -> S1(dp) S1(tp)
    view_10 = torch.ops.aten.view.default(gelu_default, [128, 64]);  gelu_default = None
    # transformer.h.0.mlp.c_proj: redistribute view_10 S1(dp) S1(tp) -> R R
    contiguous_13 = torch.ops.aten.contiguous.default(view_10);  view_10 = None
    all_gather_into_tensor_20 = torch.ops._c10d_functional.all_gather_into_tensor.default(contiguous_13, 2, Group.tp);  contiguous_13 = None
    wait_tensor_12 = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor_20);  all_gather_into_tensor_20 = None
    all_gather_into_tensor_21 = torch.ops._c10d_functional.all_gather_into_tensor.default(wait_tensor_12, 2, Group.dp);  wait_tensor_12 = None
    wait_tensor_13 = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor_21);  all_gather_into_tensor_21 = None
    unflatten_2 = torch.ops.aten.unflatten.int(wait_tensor_13, 0, [4, 128]);  wait_tensor_13 = None
    movedim_2 = torch.ops.aten.movedim.int(unflatten_2, 0, 1);  unflatten_2 = None
    view_10_replicated = torch.ops.aten.flatten.using_ints(movedim_2, 1, 2);  movedim_2 = None
    addmm_3 = torch.ops.aten.addmm.default(transformer_h_0_mlp_c_proj_bias, view_10_replicated, transformer_h_0_mlp_c_proj_weight);  transformer_h_0_mlp_c_proj_bias = view_10_replicated = transformer_h_0_mlp_c_proj_weight = None
    # transformer.h.0.mlp.c_proj: S1(dp) S1(tp) -> S2(dp) S2(tp)
    view_11 = torch.ops.aten.view.default(addmm_3, [8, 16, 16]);  addmm_3 = None
    dropout_2 = torch.ops.aten.dropout.default(view_11, 0.0, True);  view_11 = None
    add_7 = torch.ops.aten.add.Tensor(add_4, dropout_2);  add_4 = dropout_2 = None
    # transformer.h.1.ln_1: redistribute add_7 S2(dp) S2(tp) -> S0(dp) S0(tp)
    contiguous_14 = torch.ops.aten.contiguous.default(add_7)
    all_gather_into_tensor_22 = torch.ops._c10d_functional.all_gather_into_tensor.default(contiguous_14, 2, Group.tp);  contiguous_14 = None
    wait_tensor_14 = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor_22);  all_gather_into_tensor_22 = None
    unflatten_3 = torch.ops.aten.unflatten.int(wait_tensor_14, 0, [2, 8]);  wait_tensor_14 = None
    movedim_3 = torch.ops.aten.movedim.int(unflatten_3, 0, 2);  unflatten_3 = None
    flatten_1 = torch.ops.aten.flatten.using_ints(movedim_3, 2, 3);  movedim_3 = None
    contiguous_15 = torch.ops.aten.contiguous.default(flatten_1);  flatten_1 = None
    all_to_all_single_1 = torch.ops._c10d_functional.all_to_all_single.default(contiguous_15, [4, 4], [4, 4], Group.dp);  contiguous_15 = None
    wait_tensor_15 = torch.ops._c10d_functional.wait_tensor.default(all_to_all_single_1);  all_to_all_single_1 = None
    unflatten_4 = torch.ops.aten.unflatten.int(wait_tensor_15, 0, [2, 4]);  wait_tensor_15 = None
    movedim_4 = torch.ops.aten.movedim.int(unflatten_4, 0, 2);  unflatten_4 = None
    flatten_2 = torch.ops.aten.flatten.using_ints(movedim_4, 2, 3);  movedim_4 = None
    add_7_s0dp_s0tp = autoparallel_runtime_kernels_autograd_local_piece(flatten_2, 0, 2, coord_tp);  flatten_2 = coord_tp = None
    wait_tensor_16 = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor_23);  all_gather_into_tensor_23 = None
    all_gather_into_tensor_24 = torch.ops._c10d_functional.all_gather_into_tensor.default(wait_tensor_16, 2, Group.dp);  wait_tensor_16 = None
    # transformer.h.1.ln_1: redistribute transformer_h_1_ln_1_bias S0(dp) S0(tp) -> R R
    contiguous_17 = torch.ops.aten.contiguous.default(transformer_h_1_ln_1_bias);  transformer_h_1_ln_1_bias = None
    all_gather_into_tensor_25 = torch.ops._c10d_functional.all_gather_into_tensor.default(contiguous_17, 2, Group.tp);  contiguous_17 = None
    wait_tensor_17 = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor_25);  all_gather_into_tensor_25 = None
    all_gather_into_tensor_26 = torch.ops._c10d_functional.all_gather_into_tensor.default(wait_tensor_17, 2, Group.dp);  wait_tensor_17 = None
    transformer_h_1_ln_1_weight_replicated = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor_24);  all_gather_into_tensor_24 = None
    transformer_h_1_ln_1_bias_replicated = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor_26);  all_gather_into_tensor_26 = None
    # transformer.h.1.attn.c_attn: redistribute transformer_h_1_attn_c_attn_bias S0(dp) S0(tp) -> R R
    contiguous_18 = torch.ops.aten.contiguous.default(transformer_h_1_attn_c_attn_bias);  transformer_h_1_attn_c_attn_bias = None
    all_gather_into_tensor_27 = torch.ops._c10d_functional.all_gather_into_tensor.default(contiguous_18, 2, Group.tp);  contiguous_18 = None
    layer_norm_2 = torch.ops.aten.layer_norm.default(add_7_s0dp_s0tp, [64], transformer_h_1_ln_1_weight_replicated, transformer_h_1_ln_1_bias_replicated, 1e-05, False);  add_7_s0dp_s0tp = transformer_h_1_ln_1_weight_replicated = transformer_h_1_ln_1_bias_replicated = None
    # transformer.h.1.attn.c_attn: S0(dp) S0(tp) -> S0(dp) S0(tp)
    view_12 = torch.ops.aten.view.default(layer_norm_2, [32, 64]);  layer_norm_2 = None
    wait_tensor_18 = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor_27);  all_gather_into_tensor_27 = None
    all_gather_into_tensor_28 = torch.ops._c10d_functional.all_gather_into_tensor.default(wait_tensor_18, 2, Group.dp);  wait_tensor_18 = None
    transformer_h_1_attn_c_attn_bias_replicated = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor_28);  all_gather_into_tensor_28 = None
    slice_tensor_7 = torch.ops.aten.slice.Tensor(transformer_h_1_attn_c_attn_weight, 1, 0, 64)
    # transformer.h.1.attn.c_attn: redistribute slice_tensor_7 S0(dp) S0(tp) -> R R
    contiguous_19 = torch.ops.aten.contiguous.default(slice_tensor_7);  slice_tensor_7 = None
    all_gather_into_tensor_29 = torch.ops._c10d_functional.all_gather_into_tensor.default(contiguous_19, 2, Group.tp);  contiguous_19 = None
    slice_tensor_6 = torch.ops.aten.slice.Tensor(transformer_h_1_attn_c_attn_bias_replicated, 0, 0, 64)
    wait_tensor_19 = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor_29);  all_gather_into_tensor_29 = None
    all_gather_into_tensor_30 = torch.ops._c10d_functional.all_gather_into_tensor.default(wait_tensor_19, 2, Group.dp);  wait_tensor_19 = None
    slice_tensor_7_replicated = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor_30);  all_gather_into_tensor_30 = None
    slice_tensor_9 = torch.ops.aten.slice.Tensor(transformer_h_1_attn_c_attn_weight, 1, 64, 128)
    # transformer.h.1.attn.c_attn: redistribute slice_tensor_9 S0(dp) S0(tp) -> R R
    contiguous_20 = torch.ops.aten.contiguous.default(slice_tensor_9);  slice_tensor_9 = None
    all_gather_into_tensor_31 = torch.ops._c10d_functional.all_gather_into_tensor.default(contiguous_20, 2, Group.tp);  contiguous_20 = None
    addmm_default_3 = torch.ops.aten.addmm.default(slice_tensor_6, view_12, slice_tensor_7_replicated);  slice_tensor_6 = slice_tensor_7_replicated = None
    # transformer.h.1.attn.c_attn: S0(dp) S0(tp) -> S0(dp) S0(tp)
    view_default_3 = torch.ops.aten.view.default(addmm_default_3, [2, 16, 64]);  addmm_default_3 = None
    slice_tensor_8 = torch.ops.aten.slice.Tensor(transformer_h_1_attn_c_attn_bias_replicated, 0, 64, 128)
    wait_tensor_20 = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor_31);  all_gather_into_tensor_31 = None
    all_gather_into_tensor_32 = torch.ops._c10d_functional.all_gather_into_tensor.default(wait_tensor_20, 2, Group.dp);  wait_tensor_20 = None
    slice_tensor_9_replicated = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor_32);  all_gather_into_tensor_32 = None
    slice_tensor_11 = torch.ops.aten.slice.Tensor(transformer_h_1_attn_c_attn_weight, 1, 128, 192);  transformer_h_1_attn_c_attn_weight = None
    # transformer.h.1.attn.c_attn: redistribute slice_tensor_11 S0(dp) S0(tp) -> R R
    contiguous_21 = torch.ops.aten.contiguous.default(slice_tensor_11);  slice_tensor_11 = None
    all_gather_into_tensor_33 = torch.ops._c10d_functional.all_gather_into_tensor.default(contiguous_21, 2, Group.tp);  contiguous_21 = None
    addmm_default_4 = torch.ops.aten.addmm.default(slice_tensor_8, view_12, slice_tensor_9_replicated);  slice_tensor_8 = slice_tensor_9_replicated = None
    # transformer.h.1.attn.c_attn: S0(dp) S0(tp) -> S0(dp) S0(tp)
    view_default_4 = torch.ops.aten.view.default(addmm_default_4, [2, 16, 64]);  addmm_default_4 = None
    slice_tensor_10 = torch.ops.aten.slice.Tensor(transformer_h_1_attn_c_attn_bias_replicated, 0, 128, 192);  transformer_h_1_attn_c_attn_bias_replicated = None
    wait_tensor_21 = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor_33);  all_gather_into_tensor_33 = None
    all_gather_into_tensor_34 = torch.ops._c10d_functional.all_gather_into_tensor.default(wait_tensor_21, 2, Group.dp);  wait_tensor_21 = None
    slice_tensor_11_replicated = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor_34);  all_gather_into_tensor_34 = None
    # transformer.h.1.ln_2: redistribute transformer_h_1_ln_2_weight S0(dp) S0(tp) -> R R
    contiguous_25 = torch.ops.aten.contiguous.default(transformer_h_1_ln_2_weight);  transformer_h_1_ln_2_weight = None
    all_gather_into_tensor_39 = torch.ops._c10d_functional.all_gather_into_tensor.default(contiguous_25, 2, Group.tp);  contiguous_25 = None
    addmm_default_5 = torch.ops.aten.addmm.default(slice_tensor_10, view_12, slice_tensor_11_replicated);  slice_tensor_10 = view_12 = slice_tensor_11_replicated = None
    # transformer.h.1.attn.c_attn: S0(dp) S0(tp) -> S0(dp) S0(tp)
    view_default_5 = torch.ops.aten.view.default(addmm_default_5, [2, 16, 64]);  addmm_default_5 = None
    # transformer.h.1.attn: S0(dp) S0(tp) -> S0(dp) S0(tp)
    view_14 = torch.ops.aten.view.default(view_default_4, [2, 16, 4, 16]);  view_default_4 = None
    transpose_4 = torch.ops.aten.transpose.int(view_14, 1, 2);  view_14 = None
    # transformer.h.1.attn: S0(dp) S0(tp) -> S0(dp) S0(tp)
    view_15 = torch.ops.aten.view.default(view_default_5, [2, 16, 4, 16]);  view_default_5 = None
    transpose_5 = torch.ops.aten.transpose.int(view_15, 1, 2);  view_15 = None
    # transformer.h.1.attn: S0(dp) S0(tp) -> S0(dp) S0(tp)
    view_16 = torch.ops.aten.view.default(view_default_3, [2, 16, 4, 16]);  view_default_3 = None
    transpose_6 = torch.ops.aten.transpose.int(view_16, 1, 2);  view_16 = None
    scaled_dot_product_attention_1 = torch.ops.aten.scaled_dot_product_attention.default(transpose_6, transpose_4, transpose_5, None, scale = 0.25, is_causal = True);  transpose_6 = transpose_4 = transpose_5 = None
    # transformer.h.1.attn: S0(dp) S0(tp) -> S0(dp) S0(tp)
    reshape_2 = torch.ops.aten.reshape.default(scaled_dot_product_attention_1, [2, 4, 16, 16]);  scaled_dot_product_attention_1 = None
    transpose_7 = torch.ops.aten.transpose.int(reshape_2, 1, 2);  reshape_2 = None
    # transformer.h.1.attn: S0(dp) S0(tp) -> S0(dp) S0(tp)
    reshape_3 = torch.ops.aten.reshape.default(transpose_7, [2, 16, 64]);  transpose_7 = None
    # transformer.h.1.attn.c_proj: redistribute reshape_3 S0(dp) S0(tp) -> S0(dp) R
    contiguous_22 = torch.ops.aten.contiguous.default(reshape_3);  reshape_3 = None
    all_gather_into_tensor_35 = torch.ops._c10d_functional.all_gather_into_tensor.default(contiguous_22, 2, Group.tp);  contiguous_22 = None
    reshape_3_s0dp_r = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor_35);  all_gather_into_tensor_35 = None
    # transformer.h.1.attn.c_proj: S0(dp) R -> S0(dp) R
    view_17 = torch.ops.aten.view.default(reshape_3_s0dp_r, [64, 64]);  reshape_3_s0dp_r = None
    # transformer.h.1.attn.c_proj: redistribute view_17 S0(dp) R -> R R
    contiguous_23 = torch.ops.aten.contiguous.default(view_17);  view_17 = None
    all_gather_into_tensor_36 = torch.ops._c10d_functional.all_gather_into_tensor.default(contiguous_23, 2, Group.dp);  contiguous_23 = None
    view_17_replicated = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor_36);  all_gather_into_tensor_36 = None
    addmm_5 = torch.ops.aten.addmm.default(transformer_h_1_attn_c_proj_bias, view_17_replicated, transformer_h_1_attn_c_proj_weight);  transformer_h_1_attn_c_proj_bias = view_17_replicated = transformer_h_1_attn_c_proj_weight = None
    # transformer.h.1.attn.c_proj: S1(dp) S1(tp) -> S2(dp) S2(tp)
    view_18 = torch.ops.aten.view.default(addmm_5, [8, 16, 16]);  addmm_5 = None
    dropout_3 = torch.ops.aten.dropout.default(view_18, 0.0, True);  view_18 = None
    add_8 = torch.ops.aten.add.Tensor(dropout_3, add_7);  dropout_3 = add_7 = None
    # transformer.h.1.ln_2: redistribute add_8 S2(dp) S2(tp) -> R R
    contiguous_24 = torch.ops.aten.contiguous.default(add_8)
    all_gather_into_tensor_37 = torch.ops._c10d_functional.all_gather_into_tensor.default(contiguous_24, 2, Group.tp);  contiguous_24 = None
    wait_tensor_22 = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor_37);  all_gather_into_tensor_37 = None
    all_gather_into_tensor_38 = torch.ops._c10d_functional.all_gather_into_tensor.default(wait_tensor_22, 2, Group.dp);  wait_tensor_22 = None
    wait_tensor_23 = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor_38);  all_gather_into_tensor_38 = None
    unflatten_5 = torch.ops.aten.unflatten.int(wait_tensor_23, 0, [4, 8]);  wait_tensor_23 = None
    movedim_5 = torch.ops.aten.movedim.int(unflatten_5, 0, 2);  unflatten_5 = None
    add_8_replicated = torch.ops.aten.flatten.using_ints(movedim_5, 2, 3);  movedim_5 = None
    wait_tensor_24 = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor_39);  all_gather_into_tensor_39 = None
    all_gather_into_tensor_40 = torch.ops._c10d_functional.all_gather_into_tensor.default(wait_tensor_24, 2, Group.dp);  wait_tensor_24 = None
    # transformer.h.1.ln_2: redistribute transformer_h_1_ln_2_bias S0(dp) S0(tp) -> R R
    contiguous_26 = torch.ops.aten.contiguous.default(transformer_h_1_ln_2_bias);  transformer_h_1_ln_2_bias = None
    all_gather_into_tensor_41 = torch.ops._c10d_functional.all_gather_into_tensor.default(contiguous_26, 2, Group.tp);  contiguous_26 = None
    wait_tensor_25 = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor_41);  all_gather_into_tensor_41 = None
    all_gather_into_tensor_42 = torch.ops._c10d_functional.all_gather_into_tensor.default(wait_tensor_25, 2, Group.dp);  wait_tensor_25 = None
    transformer_h_1_ln_2_weight_replicated = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor_40);  all_gather_into_tensor_40 = None
    transformer_h_1_ln_2_bias_replicated = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor_42);  all_gather_into_tensor_42 = None
    # transformer.ln_f: redistribute transformer_ln_f_weight S0(dp) S0(tp) -> R R
    contiguous_30 = torch.ops.aten.contiguous.default(transformer_ln_f_weight);  transformer_ln_f_weight = None
    all_gather_into_tensor_46 = torch.ops._c10d_functional.all_gather_into_tensor.default(contiguous_30, 2, Group.tp);  contiguous_30 = None
    layer_norm_3 = torch.ops.aten.layer_norm.default(add_8_replicated, [64], transformer_h_1_ln_2_weight_replicated, transformer_h_1_ln_2_bias_replicated, 1e-05, False);  add_8_replicated = transformer_h_1_ln_2_weight_replicated = transformer_h_1_ln_2_bias_replicated = None
    view_19 = torch.ops.aten.view.default(layer_norm_3, [128, 64]);  layer_norm_3 = None
    addmm_6 = torch.ops.aten.addmm.default(transformer_h_1_mlp_c_fc_bias, view_19, transformer_h_1_mlp_c_fc_weight);  transformer_h_1_mlp_c_fc_bias = view_19 = transformer_h_1_mlp_c_fc_weight = None
    # transformer.h.1.mlp.c_fc: S1(dp) S1(tp) -> S2(dp) S2(tp)
    view_20 = torch.ops.aten.view.default(addmm_6, [8, 16, 64]);  addmm_6 = None
    gelu_default_1 = torch.ops.aten.gelu.default(view_20, approximate = 'tanh');  view_20 = None
    # transformer.h.1.mlp.c_proj: S2(dp) S2(tp) -> S1(dp) S1(tp)
    view_21 = torch.ops.aten.view.default(gelu_default_1, [128, 64]);  gelu_default_1 = None
    # transformer.h.1.mlp.c_proj: redistribute view_21 S1(dp) S1(tp) -> R R
    contiguous_27 = torch.ops.aten.contiguous.default(view_21);  view_21 = None
    all_gather_into_tensor_43 = torch.ops._c10d_functional.all_gather_into_tensor.default(contiguous_27, 2, Group.tp);  contiguous_27 = None
    wait_tensor_26 = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor_43);  all_gather_into_tensor_43 = None
    all_gather_into_tensor_44 = torch.ops._c10d_functional.all_gather_into_tensor.default(wait_tensor_26, 2, Group.dp);  wait_tensor_26 = None
    wait_tensor_27 = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor_44);  all_gather_into_tensor_44 = None
    unflatten_6 = torch.ops.aten.unflatten.int(wait_tensor_27, 0, [4, 128]);  wait_tensor_27 = None
    movedim_6 = torch.ops.aten.movedim.int(unflatten_6, 0, 1);  unflatten_6 = None
    view_21_replicated = torch.ops.aten.flatten.using_ints(movedim_6, 1, 2);  movedim_6 = None
    addmm_7 = torch.ops.aten.addmm.default(transformer_h_1_mlp_c_proj_bias, view_21_replicated, transformer_h_1_mlp_c_proj_weight);  transformer_h_1_mlp_c_proj_bias = view_21_replicated = transformer_h_1_mlp_c_proj_weight = None
    # transformer.h.1.mlp.c_proj: S1(dp) S1(tp) -> S2(dp) S2(tp)
    view_22 = torch.ops.aten.view.default(addmm_7, [8, 16, 16]);  addmm_7 = None
    dropout_4 = torch.ops.aten.dropout.default(view_22, 0.0, True);  view_22 = None
    add_11 = torch.ops.aten.add.Tensor(add_8, dropout_4);  add_8 = dropout_4 = None
    # transformer.ln_f: redistribute add_11 S2(dp) S2(tp) -> S0(dp) R
    contiguous_28 = torch.ops.aten.contiguous.default(add_11);  add_11 = None
    all_gather_into_tensor_45 = torch.ops._c10d_functional.all_gather_into_tensor.default(contiguous_28, 2, Group.tp);  contiguous_28 = None
    wait_tensor_28 = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor_45);  all_gather_into_tensor_45 = None
    unflatten_7 = torch.ops.aten.unflatten.int(wait_tensor_28, 0, [2, 8]);  wait_tensor_28 = None
    movedim_7 = torch.ops.aten.movedim.int(unflatten_7, 0, 2);  unflatten_7 = None
    flatten_3 = torch.ops.aten.flatten.using_ints(movedim_7, 2, 3);  movedim_7 = None
    contiguous_29 = torch.ops.aten.contiguous.default(flatten_3);  flatten_3 = None
    all_to_all_single_2 = torch.ops._c10d_functional.all_to_all_single.default(contiguous_29, [4, 4], [4, 4], Group.dp);  contiguous_29 = None
    wait_tensor_29 = torch.ops._c10d_functional.wait_tensor.default(all_to_all_single_2);  all_to_all_single_2 = None
    unflatten_8 = torch.ops.aten.unflatten.int(wait_tensor_29, 0, [2, 4]);  wait_tensor_29 = None
    movedim_8 = torch.ops.aten.movedim.int(unflatten_8, 0, 2);  unflatten_8 = None
    add_11_s0dp_r = torch.ops.aten.flatten.using_ints(movedim_8, 2, 3);  movedim_8 = None
    wait_tensor_30 = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor_46);  all_gather_into_tensor_46 = None
    all_gather_into_tensor_47 = torch.ops._c10d_functional.all_gather_into_tensor.default(wait_tensor_30, 2, Group.dp);  wait_tensor_30 = None
    # transformer.ln_f: redistribute transformer_ln_f_bias S0(dp) S0(tp) -> R R
    contiguous_31 = torch.ops.aten.contiguous.default(transformer_ln_f_bias);  transformer_ln_f_bias = None
    all_gather_into_tensor_48 = torch.ops._c10d_functional.all_gather_into_tensor.default(contiguous_31, 2, Group.tp);  contiguous_31 = None
    wait_tensor_31 = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor_48);  all_gather_into_tensor_48 = None
    all_gather_into_tensor_49 = torch.ops._c10d_functional.all_gather_into_tensor.default(wait_tensor_31, 2, Group.dp);  wait_tensor_31 = None
    transformer_ln_f_weight_replicated = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor_47);  all_gather_into_tensor_47 = None
    transformer_ln_f_bias_replicated = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor_49);  all_gather_into_tensor_49 = None
    # lm_head: redistribute transformer_wte_weight_1 S1(dp) S0(tp) -> R S0(tp)
    contiguous_32 = torch.ops.aten.contiguous.default(transformer_wte_weight_1);  transformer_wte_weight_1 = None
    all_gather_into_tensor_50 = torch.ops._c10d_functional.all_gather_into_tensor.default(contiguous_32, 2, Group.dp);  contiguous_32 = None
    layer_norm_4 = torch.ops.aten.layer_norm.default(add_11_s0dp_r, [64], transformer_ln_f_weight_replicated, transformer_ln_f_bias_replicated, 1e-05, False);  add_11_s0dp_r = transformer_ln_f_weight_replicated = transformer_ln_f_bias_replicated = None
    # transformer: S0(dp) R -> S0(dp) R
    view_23 = torch.ops.aten.view.default(layer_norm_4, [4, 16, 64]);  layer_norm_4 = None
    alias = torch.ops.aten.alias.default(view_23);  view_23 = None
    wait_tensor_32 = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor_50);  all_gather_into_tensor_50 = None
    unflatten_9 = torch.ops.aten.unflatten.int(wait_tensor_32, 0, [2, 64]);  wait_tensor_32 = None
    movedim_9 = torch.ops.aten.movedim.int(unflatten_9, 0, 1);  unflatten_9 = None
    transformer_wte_weight_1_r_s0tp = torch.ops.aten.flatten.using_ints(movedim_9, 1, 2);  movedim_9 = None
    linear = torch.ops.aten.linear.default(alias, transformer_wte_weight_1_r_s0tp);  alias = transformer_wte_weight_1_r_s0tp = None
    to_3 = torch.ops.aten.to.dtype(linear, torch.float32);  linear = None
    pad = torch.ops.aten.pad.default(labels, [0, 1], 'constant', -100.0);  labels = None
    slice_2 = torch.ops.aten.slice.Tensor(pad, 1, 1, 9223372036854775807);  pad = None
    contiguous = torch.ops.aten.contiguous.default(slice_2);  slice_2 = None
    # S0(dp) S2(tp) -> S0(dp) S1(tp)
    view_24 = torch.ops.aten.view.default(to_3, [64, 64])
    view_25 = torch.ops.aten.view.default(contiguous, [128]);  contiguous = None
    to_4 = torch.ops.aten.to.dtype_layout(view_25, dtype = torch.int64, layout = torch.strided, device = device(type='cpu'));  view_25 = None
    # redistribute view_24 S0(dp) S1(tp) -> R R
    contiguous_33 = torch.ops.aten.contiguous.default(view_24);  view_24 = None
    all_gather_into_tensor_51 = torch.ops._c10d_functional.all_gather_into_tensor.default(contiguous_33, 2, Group.dp);  contiguous_33 = None
    wait_tensor_33 = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor_51);  all_gather_into_tensor_51 = None
    all_gather_into_tensor_52 = torch.ops._c10d_functional.all_gather_into_tensor.default(wait_tensor_33, 2, Group.tp);  wait_tensor_33 = None
    wait_tensor_34 = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor_52);  all_gather_into_tensor_52 = None
    unflatten_10 = torch.ops.aten.unflatten.int(wait_tensor_34, 0, [2, 128]);  wait_tensor_34 = None
    movedim_10 = torch.ops.aten.movedim.int(unflatten_10, 0, 1);  unflatten_10 = None
    view_24_replicated = torch.ops.aten.flatten.using_ints(movedim_10, 1, 2);  movedim_10 = None
    cross_entropy_loss = autoparallel_runtime_kernels_cross_entropy_cross_entropy_loss(view_24_replicated, to_4, 1, -100);  view_24_replicated = to_4 = None
    returned = autoparallel_runtime_kernels_autograd_returned(cross_entropy_loss, 4);  cross_entropy_loss = None
    returned_1 = autoparallel_runtime_kernels_autograd_returned(to_3, 1);  to_3 = None
    return (returned, returned_1)
    