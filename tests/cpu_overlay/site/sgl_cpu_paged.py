"""CPU stand-in for the paged allocator's Triton decode kernel (0.5.19-0.5.21), which needs a GPU.

The same computation as upstream 0.5.22's own `alloc_decode_naive` (its
non-Triton path), called with the kernel's arguments: each request whose next
token starts a page takes the next free page, in order; the others continue
after their last location.
"""

import torch


def alloc_decode(seq_lens, last_loc, free_pages, out_indices, page_size):
    need_new_page = ((seq_lens - 1) % page_size == 0).to(torch.int64)
    num_new_pages = int(need_new_page.sum())
    if num_new_pages == 0:
        out_indices.copy_(last_loc + 1)
        return
    new_page_rank = (torch.cumsum(need_new_page, 0) - need_new_page).clamp_(max=num_new_pages - 1)
    new_page_start = free_pages[new_page_rank] * page_size
    out_indices.copy_(torch.where(need_new_page.bool(), new_page_start, last_loc + 1))
