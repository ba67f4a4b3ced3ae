//! An OpenAI request body from fuzzer bytes through every validation step the server runs before
//! tokenizing: JSON, shared parameters (chat and completion semantics), `model`, unsupported
//! fields, messages, the completion prompt. Errors are fine; panics are findings.
#![no_main]

use libfuzzer_sys::fuzz_target;
use strata_server::request::{chat_messages, check_model, completion_prompt, gen_params, refuse_unsupported, UNSUPPORTED_CHAT, UNSUPPORTED_COMPLETION};

fuzz_target!(|data: &[u8]| {
    let Ok(body) = serde_json::from_slice::<serde_json::Value>(data) else { return };
    let defaults = strata_engine::SamplingParams::default();
    let _ = gen_params(&body, &defaults, true);
    let _ = gen_params(&body, &defaults, false);
    let _ = check_model(&body, "model", &["alias".to_string()]);
    let _ = refuse_unsupported(&body, &UNSUPPORTED_CHAT);
    let _ = refuse_unsupported(&body, &UNSUPPORTED_COMPLETION);
    if let Ok(p) = completion_prompt(&body) {
        let _ = p.text_bytes();
    }
    if let Ok(m) = chat_messages(&body) {
        let _ = m.len();
    }
});
