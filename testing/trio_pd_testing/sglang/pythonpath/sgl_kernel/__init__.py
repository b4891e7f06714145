"""stub"""


def copy_all_layer_kv_cache_cpu(*args, **kwargs):
    raise NotImplementedError("copy_all_layer_kv_cache_cpu")


def assign_req_to_token_pool_cpu(*args, **kwargs):
    raise NotImplementedError("assign_req_to_token_pool_cpu")


def build_tree_kernel_efficient_cpu(*args, **kwargs):
    raise NotImplementedError("build_tree_kernel_efficient_cpu")


def verify_tree_greedy_cpu(*args, **kwargs):
    raise NotImplementedError("verify_tree_greedy_cpu")


def assign_draft_cache_locs_contiguous_cpu(*args, **kwargs):
    raise NotImplementedError("assign_draft_cache_locs_contiguous_cpu")


def assign_extend_cache_locs_cpu(*args, **kwargs):
    raise NotImplementedError("assign_extend_cache_locs_cpu")


def fill_accept_out_cache_loc_cpu(*args, **kwargs):
    raise NotImplementedError("fill_accept_out_cache_loc_cpu")


def fill_bonus_tokens_cpu(*args, **kwargs):
    raise NotImplementedError("fill_bonus_tokens_cpu")
