//! Chat templates render exactly as transformers' `apply_chat_template` renders them. The expected
//! strings come from `scripts/make_chat_template_fixture.py` (transformers 5.23).

use std::path::PathBuf;

use strata_formats::{ChatMessage, ChatTemplate};

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/chat")
}

#[test]
fn renders_equal_transformers() {
    let dir = fixtures();
    let exp: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json")).unwrap()).unwrap();
    let (bos, eos) = (
        exp["tokens"]["bos_token"].as_str().unwrap(),
        exp["tokens"]["eos_token"].as_str().unwrap(),
    );
    let cases = exp["cases"].as_array().unwrap();
    assert!(cases.len() >= 6);
    for case in cases {
        let src = std::fs::read_to_string(dir.join(case["template"].as_str().unwrap())).unwrap();
        let tpl = ChatTemplate::new(&src, bos, eos).unwrap();
        let messages: Vec<ChatMessage> = serde_json::from_value(case["messages"].clone()).unwrap();
        let got = tpl.render(&messages, case["add_generation_prompt"].as_bool().unwrap()).unwrap();
        assert_eq!(
            got,
            case["expected"].as_str().unwrap(),
            "template {} conversation {}",
            case["template"],
            case["conversation"]
        );
    }
}

#[test]
fn raise_exception_is_an_error_not_a_panic() {
    let src = std::fs::read_to_string(fixtures().join("features.jinja")).unwrap();
    let tpl = ChatTemplate::new(&src, "<s>", "</s>").unwrap();
    let err = tpl.render(&[ChatMessage::new("tool", "x")], true).unwrap_err();
    assert!(err.to_string().contains("bad role tool"), "{err}");
    assert!(ChatTemplate::new("{% for %}", "", "").is_err());
}
