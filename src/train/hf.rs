//! What Hugging Face tools expect beside the weights, so that a folder tinyllm
//! writes (a checkpoint or [`save_model`](super::checkpoint::save_model)'s)
//! loads in `transformers` as it is (`AutoModelForCausalLM.from_pretrained(DIR)`,
//! `AutoTokenizer.from_pretrained(DIR)`, a `text-generation` pipeline):
//!
//! * `generation_config.json` — sampling as `tinyllm generate` does it by
//!   default (temperature 0.8, top-k 40), at most the model's context;
//! * `tokenizer.json` — the model's tokens are the 256 bytes of UTF-8 text,
//!   id = byte value. Written for the `tokenizers` library as a BPE model
//!   with no merges whose vocabulary is exactly the 256 byte tokens `<0x00>` …
//!   `<0xFF>` and `byte_fallback` on: every character is missing from the
//!   vocabulary, so each one falls back to its UTF-8 bytes, each byte to the
//!   token of its value. No normalizer, no pre-tokenizer (no `ByteLevel`
//!   remapping, no added prefix space), no special tokens; the decoder turns
//!   the byte tokens back into bytes (`ByteFallback`) and joins them (`Fuse`);
//! * `tokenizer_config.json` — `PreTrainedTokenizerFast` over that file, no
//!   BOS/EOS added (tinyllm trains without them).

use crate::nn::llama::LlamaConfig;

/// The sampling defaults.
pub const GENERATION_CONFIG_FILE: &str = "generation_config.json";
/// The byte-level tokenizer, for the `tokenizers` library.
pub const TOKENIZER_FILE: &str = "tokenizer.json";
/// The `transformers` tokenizer settings.
pub const TOKENIZER_CONFIG_FILE: &str = "tokenizer_config.json";
/// The files written beside the weights, in the order they are written.
pub const HF_FILES: [&str; 3] = [
    GENERATION_CONFIG_FILE,
    TOKENIZER_FILE,
    TOKENIZER_CONFIG_FILE,
];

/// The token `tokenizers`' byte fallback gives byte `b`: `<0x0A>` for a newline.
pub fn byte_token(b: u8) -> String {
    format!("<0x{b:02X}>")
}

/// `generation_config.json` for a model of `cfg`.
pub fn generation_config(cfg: &LlamaConfig) -> serde_json::Value {
    serde_json::json!({
        "do_sample": true,
        "temperature": 0.8,
        "top_k": 40,
        "max_length": cfg.context,
        "bos_token_id": null,
        "eos_token_id": null,
        "pad_token_id": null,
    })
}

/// `tokenizer.json`: the 256 bytes, id = byte value (see the module docs).
pub fn tokenizer() -> serde_json::Value {
    let vocab: serde_json::Map<String, serde_json::Value> = (0..=255u8)
        .map(|b| (byte_token(b), serde_json::Value::from(b)))
        .collect();
    serde_json::json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [],
        "normalizer": null,
        "pre_tokenizer": null,
        "post_processor": null,
        "decoder": {
            "type": "Sequence",
            "decoders": [{"type": "ByteFallback"}, {"type": "Fuse"}],
        },
        "model": {
            "type": "BPE",
            "dropout": null,
            "unk_token": null,
            "continuing_subword_prefix": null,
            "end_of_word_suffix": null,
            "fuse_unk": false,
            "byte_fallback": true,
            "ignore_merges": false,
            "vocab": vocab,
            "merges": [],
        },
    })
}

/// `tokenizer_config.json` for a model of `cfg`.
pub fn tokenizer_config(cfg: &LlamaConfig) -> serde_json::Value {
    serde_json::json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": cfg.context,
        "add_bos_token": false,
        "add_eos_token": false,
        "bos_token": null,
        "eos_token": null,
        "unk_token": null,
        "pad_token": null,
        "clean_up_tokenization_spaces": false,
    })
}

/// The files of [`HF_FILES`] for `cfg`, as bytes, in that order.
pub fn files(cfg: &LlamaConfig) -> Vec<(&'static str, Vec<u8>)> {
    let json = |v: serde_json::Value| {
        // A JSON value of strings, numbers and maps always serialises.
        serde_json::to_vec_pretty(&v).unwrap_or_default()
    };
    vec![
        (GENERATION_CONFIG_FILE, json(generation_config(cfg))),
        (TOKENIZER_FILE, json(tokenizer())),
        (TOKENIZER_CONFIG_FILE, json(tokenizer_config(cfg))),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_vocabulary_is_the_bytes() {
        let t = tokenizer();
        let v = t["model"]["vocab"].as_object().unwrap();
        assert_eq!(v.len(), 256);
        assert_eq!(v["<0x0A>"], 10);
        assert_eq!(v["<0xFF>"], 255);
        assert_eq!(byte_token(b' '), "<0x20>");
    }
}
