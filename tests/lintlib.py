"""Shared test material."""
import textwrap

# The smallest script with a finding: DDP, accumulation over 4 micro-steps, no sync control (SC101 on
# line 5 of the dedented text).
BAD_LOOP = textwrap.dedent("""\
    from torch.nn.parallel import DistributedDataParallel as DDP
    model = DDP(model)
    for i, (x, y) in enumerate(loader):
        loss = model(x).sum() / 4
        loss.backward()
        if (i + 1) % 4 == 0:
            optimizer.step()
            optimizer.zero_grad()
""")
