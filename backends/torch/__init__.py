"""The torch backend (cuda, mps, cpu). Importing this package does not import torch;
`device.cuda_available` works without it."""
