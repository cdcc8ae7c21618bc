"""Training data: reading files (:mod:`.io`), SFT examples (:mod:`.sft`), batching and packing (:mod:`.packing`).

Import the submodules directly; this package stays empty so that importing ``rlctl.data.io`` does not
pull in torch.
"""
