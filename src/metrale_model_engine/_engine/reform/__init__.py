"""The link's re-form once worker ranks are lost: ``side`` (what a link keeps across its epochs: its model's
opt-in, the channel its ranks meet again through), ``head`` (the head decides who forms the next epoch, and
forms it, again without a rank lost meanwhile) and ``worker`` (a worker joins what the head formed, or ends)."""
