//! The Llama (written with the trainer).
