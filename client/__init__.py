"""lorad client SDK and CLI; imports neither torch nor onnxruntime."""
