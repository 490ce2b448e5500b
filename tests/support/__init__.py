"""Test support: tiny random models and adapters in Hugging Face and PEFT layout."""
