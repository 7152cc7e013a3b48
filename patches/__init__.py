"""SGLang patches (installed as ``sglang_kdtree.patches``): one small module per patched SGLang symbol."""
