"""plinth-ipex: Intel Extension for PyTorch as a kernel provider for plinth's cpu backend."""
