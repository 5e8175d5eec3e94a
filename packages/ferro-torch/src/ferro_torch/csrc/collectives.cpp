// collectives.cpp: the collectives that move blocks between ranks: all_gather (its list,
// into-tensor and coalesced forms), gather, scatter, reduce_scatter (list, tensor,
// coalesced), all_to_all_single without splits (the list form and splits: python.cpp).
//
// A block of one tensor per rank goes to the door as one buffer: the tensors themselves where
// they lie one after another in memory (chunks of one tensor), else a staging copy.
#include "ferro_c10d.hpp"

namespace ferro_torch {

using c10d::OpType;

namespace {

// `n` tensors like `like` (same dtype and element count), else ValueError naming `what`
void check_blocks(const char* name, const std::vector<at::Tensor>& ts, size_t n,
                  const at::Tensor& like, const char* what) {
  TORCH_CHECK_VALUE(ts.size() == n, name, ": ", ts.size(), " ", what, " tensors, expected ", n);
  for (const auto& t : ts) {
    check_cpu(name, t);
    // (the shape, not only the count: as gloo, a block is not reshaped silently)
    TORCH_CHECK_VALUE(t.sizes() == like.sizes() && t.scalar_type() == like.scalar_type(), name,
                      ": ", what, " ", t.scalar_type(), t.sizes(), " does not match ",
                      like.scalar_type(), like.sizes());
  }
}

// `whole` holds `n` times the elements of `part`, of the same dtype
void check_whole(const char* name, const at::Tensor& whole, const at::Tensor& part, int64_t n,
                 const char* which) {
  check_cpu(name, whole);
  check_cpu(name, part);
  TORCH_CHECK_VALUE(whole.numel() == n * part.numel() && whole.scalar_type() ==
                    part.scalar_type(), name, ": ", which, " ", whole.scalar_type(),
                    whole.sizes(), ", expected ", n, " x ", part.scalar_type(), part.sizes());
}

// the blocks as one flat tensor: their span, or a new staging tensor (`read`: with their data)
at::Tensor blocks(const std::vector<at::Tensor>& ts, bool read) {
  at::Tensor whole = span(ts);
  if (whole.defined()) return whole;
  if (read) {
    std::vector<at::Tensor> flat;
    flat.reserve(ts.size());
    for (const auto& t : ts) flat.push_back(t.reshape({-1}));
    return at::cat(flat);
  }
  return at::empty({static_cast<int64_t>(ts.size()) * ts[0].numel()}, ts[0].options()
                   .requires_grad(false));
}

// the staging tensor's blocks into `ts` (nothing when `whole` is their span)
void unblock(const at::Tensor& whole, const std::vector<at::Tensor>& ts) {
  if (ts.empty() || whole.data_ptr() == ts[0].data_ptr()) return;
  at::NoGradGuard g;
  const int64_t k = ts[0].numel();
  for (size_t r = 0; r < ts.size(); ++r)
    ts[r].copy_(whole.narrow(0, static_cast<int64_t>(r) * k, k).view(ts[r].sizes()));
}

}  // namespace

// ---------------------------------------------------------------------------- all_gather
WorkPtr FerroBackend::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                std::vector<at::Tensor>& inputs,
                                const c10d::AllgatherOptions& opts) {
  TORCH_CHECK_VALUE(outputs.size() == inputs.size(), "allgather: ", outputs.size(),
                    " output lists for ", inputs.size(), " inputs");
  for (size_t i = 0; i < inputs.size(); ++i) {
    check_cpu("allgather", inputs[i]);
    check_blocks("allgather", outputs[i], size_, inputs[i], "output");
  }
  return issue(OpType::ALLGATHER, opts.asyncOp, opts.timeout, inputs.size(), joined(outputs),
               [this, outputs, inputs](Tickets& t, double secs) {
                 for (size_t i = 0; i < inputs.size(); ++i) {
                   at::Tensor in = dense(inputs[i]);
                   at::Tensor out = blocks(outputs[i], false);
                   Items it = items_of(in);
                   door("allgather", t, secs, [&](ferro_opts* o) {
                     o->type_name = it.type_name;
                     return api_->all_gather(comm_, in.data_ptr(), out.data_ptr(), it.count,
                                             it.dtype, o);
                   });
                   unblock(out, outputs[i]);
                 }
               });
}

WorkPtr FerroBackend::_allgather_base(at::Tensor& output, at::Tensor& input,
                                      const c10d::AllgatherOptions& opts) {
  check_whole("all_gather_into_tensor", output, input, size_, "output");
  return issue(OpType::_ALLGATHER_BASE, opts.asyncOp, opts.timeout, 1, {output},
               [this, output, input](Tickets& t, double secs) {
                 at::Tensor in = dense(input), out = dense(output);
                 Items it = items_of(in);
                 door("all_gather_into_tensor", t, secs, [&](ferro_opts* o) {
                   o->type_name = it.type_name;
                   return api_->all_gather(comm_, in.data_ptr(), out.data_ptr(), it.count,
                                           it.dtype, o);
                 });
                 write_back(output, out);
               });
}

WorkPtr FerroBackend::allgather_coalesced(std::vector<std::vector<at::Tensor>>& output_lists,
                                          std::vector<at::Tensor>& inputs,
                                          const c10d::AllgatherOptions& opts) {
  // output_lists[r][i] gets rank r's inputs[i]: one all_gather per input
  TORCH_CHECK_VALUE(output_lists.size() == static_cast<size_t>(size_), "allgather_coalesced: ",
                    output_lists.size(), " output lists, expected ", size_);
  std::vector<std::vector<at::Tensor>> per_input(inputs.size());
  for (const auto& outs : output_lists) {
    TORCH_CHECK_VALUE(outs.size() == inputs.size(), "allgather_coalesced: an output list of ",
                      outs.size(), " tensors for ", inputs.size(), " inputs");
    for (size_t i = 0; i < inputs.size(); ++i) per_input[i].push_back(outs[i]);
  }
  return allgather(per_input, inputs, opts);
}

WorkPtr FerroBackend::allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                      std::vector<at::Tensor>& inputs,
                                                      const c10d::AllgatherOptions& opts) {
  TORCH_CHECK_VALUE(outputs.size() == inputs.size(), "allgather_into_tensor_coalesced: ",
                    outputs.size(), " outputs for ", inputs.size(), " inputs");
  for (size_t i = 0; i < inputs.size(); ++i)
    check_whole("all_gather_into_tensor", outputs[i], inputs[i], size_, "output");
  return issue(OpType::COALESCED, opts.asyncOp, opts.timeout, inputs.size(), outputs,
               [this, outputs, inputs](Tickets& t, double secs) {
                 for (size_t i = 0; i < inputs.size(); ++i) {
                   at::Tensor in = dense(inputs[i]), out = dense(outputs[i]);
                   Items it = items_of(in);
                   door("all_gather_into_tensor", t, secs, [&](ferro_opts* o) {
                     o->type_name = it.type_name;
                     return api_->all_gather(comm_, in.data_ptr(), out.data_ptr(), it.count,
                                             it.dtype, o);
                   });
                   write_back(outputs[i], out);
                 }
               });
}

// ---------------------------------------------------------------------------- gather, scatter
WorkPtr FerroBackend::gather(std::vector<std::vector<at::Tensor>>& outputs,
                             std::vector<at::Tensor>& inputs, const c10d::GatherOptions& opts) {
  const int root = static_cast<int>(opts.rootRank);
  TORCH_CHECK_VALUE(root >= 0 && root < size_, "gather: root ", root, " is not a rank of ", size_);
  TORCH_CHECK_VALUE(inputs.size() == 1, "gather: ", inputs.size(), " inputs, expected 1");
  check_cpu("gather", inputs[0]);
  if (rank_ == root) {
    TORCH_CHECK_VALUE(outputs.size() == 1, "gather: ", outputs.size(), " output lists on the "
                      "root, expected 1");
    check_blocks("gather", outputs[0], size_, inputs[0], "output");
  }
  return issue(OpType::GATHER, opts.asyncOp, opts.timeout, 1, joined(outputs),
               [this, outputs, inputs, root](Tickets& t, double secs) {
                 at::Tensor in = dense(inputs[0]);
                 at::Tensor out = rank_ == root ? blocks(outputs[0], false) : at::Tensor();
                 Items it = items_of(in);
                 door("gather", t, secs, [&](ferro_opts* o) {
                   o->type_name = it.type_name;
                   return api_->gather(comm_, in.data_ptr(),
                                       out.defined() ? out.data_ptr() : nullptr, it.count,
                                       it.dtype, root, o);
                 });
                 if (out.defined()) unblock(out, outputs[0]);
               });
}

WorkPtr FerroBackend::scatter(std::vector<at::Tensor>& outputs,
                              std::vector<std::vector<at::Tensor>>& inputs,
                              const c10d::ScatterOptions& opts) {
  const int root = static_cast<int>(opts.rootRank);
  TORCH_CHECK_VALUE(root >= 0 && root < size_, "scatter: root ", root, " is not a rank of ",
                    size_);
  TORCH_CHECK_VALUE(outputs.size() == 1, "scatter: ", outputs.size(), " outputs, expected 1");
  check_cpu("scatter", outputs[0]);
  if (rank_ == root) {
    TORCH_CHECK_VALUE(inputs.size() == 1, "scatter: ", inputs.size(), " input lists on the "
                      "root, expected 1");
    check_blocks("scatter", inputs[0], size_, outputs[0], "input");
  }
  return issue(OpType::SCATTER, opts.asyncOp, opts.timeout, 1, outputs,
               [this, outputs, inputs, root](Tickets& t, double secs) {
                 at::Tensor out = dense(outputs[0]);
                 at::Tensor in = rank_ == root ? dense(blocks(inputs[0], true)) : at::Tensor();
                 Items it = items_of(out);
                 door("scatter", t, secs, [&](ferro_opts* o) {
                   o->type_name = it.type_name;
                   return api_->scatter(comm_, in.defined() ? in.data_ptr() : nullptr,
                                        out.data_ptr(), it.count, it.dtype, root, o);
                 });
                 write_back(outputs[0], out);
               });
}

// ---------------------------------------------------------------------------- reduce_scatter
WorkPtr FerroBackend::reduce_scatter(std::vector<at::Tensor>& outputs,
                                     std::vector<std::vector<at::Tensor>>& inputs,
                                     const c10d::ReduceScatterOptions& opts) {
  TORCH_CHECK_VALUE(outputs.size() == inputs.size(), "reduce_scatter: ", outputs.size(),
                    " outputs for ", inputs.size(), " input lists");
  for (size_t i = 0; i < outputs.size(); ++i) {
    check_cpu("reduce_scatter", outputs[i]);
    check_blocks("reduce_scatter", inputs[i], size_, outputs[i], "input");
    if (door_op(opts.reduceOp, door_dtype(outputs[i].scalar_type()), "reduce_scatter") < 0)
      return py_reduce_scatter(outputs, inputs, opts);
  }
  return issue(OpType::REDUCE_SCATTER, opts.asyncOp, opts.timeout, outputs.size(), outputs,
               [this, outputs, inputs, rop = opts.reduceOp](Tickets& t, double secs) {
                 for (size_t i = 0; i < outputs.size(); ++i) {
                   const int dt = door_dtype(outputs[i].scalar_type());
                   const int op = door_op(rop, dt, "reduce_scatter");
                   at::Tensor in = dense(blocks(inputs[i], true)), out = dense(outputs[i]);
                   door("reduce_scatter", t, secs, [&](const ferro_opts* o) {
                     return api_->reduce_scatter(comm_, in.data_ptr(), out.data_ptr(),
                                                 out.numel(), dt, op, o);
                   });
                   write_back(outputs[i], out);
                 }
               });
}

WorkPtr FerroBackend::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                           const c10d::ReduceScatterOptions& opts) {
  std::vector<at::Tensor> outputs{output}, inputs{input};
  return reduce_scatter_tensor_coalesced(outputs, inputs, opts);
}

WorkPtr FerroBackend::reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                      std::vector<at::Tensor>& inputs,
                                                      const c10d::ReduceScatterOptions& opts) {
  TORCH_CHECK_VALUE(outputs.size() == inputs.size(), "reduce_scatter_tensor: ", outputs.size(),
                    " outputs for ", inputs.size(), " inputs");
  for (size_t i = 0; i < outputs.size(); ++i) {
    check_whole("reduce_scatter_tensor", inputs[i], outputs[i], size_, "input");
    if (door_op(opts.reduceOp, door_dtype(outputs[i].scalar_type()), "reduce_scatter_tensor")
        < 0) {
      if (outputs.size() == 1) return py_reduce_scatter_base(outputs[0], inputs[0], opts);
      std::vector<WorkPtr> works;
      for (size_t k = 0; k < outputs.size(); ++k)
        works.push_back(_reduce_scatter_base(outputs[k], inputs[k], opts));
      return c10::make_intrusive<CoalescedWork>(std::move(works));
    }
  }
  return issue(OpType::_REDUCE_SCATTER_BASE, opts.asyncOp, opts.timeout, outputs.size(),
               outputs,
               [this, outputs, inputs, rop = opts.reduceOp](Tickets& t, double secs) {
                 for (size_t i = 0; i < outputs.size(); ++i) {
                   const int dt = door_dtype(outputs[i].scalar_type());
                   const int op = door_op(rop, dt, "reduce_scatter_tensor");
                   at::Tensor in = dense(inputs[i]), out = dense(outputs[i]);
                   door("reduce_scatter_tensor", t, secs, [&](const ferro_opts* o) {
                     return api_->reduce_scatter(comm_, in.data_ptr(), out.data_ptr(),
                                                 out.numel(), dt, op, o);
                   });
                   write_back(outputs[i], out);
                 }
               });
}

// ---------------------------------------------------------------------------- all_to_all
WorkPtr FerroBackend::alltoall_base(at::Tensor& output, at::Tensor& input,
                                    std::vector<int64_t>& output_splits,
                                    std::vector<int64_t>& input_splits,
                                    const c10d::AllToAllOptions& opts) {
  check_cpu("all_to_all_single", output);
  check_cpu("all_to_all_single", input);
  // equal blocks without splits on the door; splits on the Python backend (a choice each rank
  // makes alike: whether splits were given; that they are all equal is a rank's own view)
  const int64_t rows = input.dim() ? input.size(0) : 1;
  if (!output_splits.empty() || !input_splits.empty() || rows % size_ != 0
      || output.numel() != input.numel() || output.scalar_type() != input.scalar_type())
    return py_alltoall_base(output, input, output_splits, input_splits, opts);
  return issue(OpType::ALLTOALL_BASE, opts.asyncOp, opts.timeout, 1, {output},
               [this, output, input](Tickets& t, double secs) {
                 at::Tensor in = dense(input), out = dense(output);
                 Items it = items_of(in);
                 door("all_to_all_single", t, secs, [&](ferro_opts* o) {
                   o->type_name = it.type_name;
                   return api_->all_to_all(comm_, in.data_ptr(), out.data_ptr(),
                                           it.count / size_, it.dtype, o);
                 });
                 write_back(output, out);
               });
}

WorkPtr FerroBackend::alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                               const c10d::AllToAllOptions& opts) {
  // a list of tensors of any sizes: the door takes one block size on every rank, which no
  // rank can see alone, so the Python backend runs it (in this thread, in issue order)
  return py_alltoall(outputs, inputs, opts);
}

}  // namespace ferro_torch
