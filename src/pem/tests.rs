use super::*;

#[test]
fn a_missing_file_is_named() {
    let err = certificates(Path::new("/nonexistent/cert.pem"))
        .unwrap_err()
        .to_string();
    assert!(
        err.starts_with("cannot read /nonexistent/cert.pem: "),
        "{err}"
    );
}

#[test]
fn a_malformed_file_is_named_without_its_contents() {
    let path = Path::new("/etc/tls/cert.pem");
    let text = b"-----BEGIN CERTIFICATE-----\nc2VjcmV0IHN0dWZm!!!\n-----END CERTIFICATE-----\n";
    let err = certificates_in(path, text).unwrap_err().to_string();
    assert_eq!(err, "/etc/tls/cert.pem: malformed PEM: invalid base64");
    let text = b"-----BEGIN PRIVATE KEY-----\nc2VjcmV0IHN0dWZm\n";
    let err = private_key_in(path, text).unwrap_err().to_string();
    assert_eq!(
        err,
        "/etc/tls/cert.pem: malformed PEM: a section has no END line"
    );
}

#[test]
fn a_file_without_what_is_asked_says_so() {
    let path = Path::new("k.pem");
    let err = certificates_in(path, b"nothing here\n")
        .unwrap_err()
        .to_string();
    assert_eq!(err, "k.pem: no certificate in it (a PEM CERTIFICATE block)");
    let err = private_key_in(path, b"nothing here\n")
        .unwrap_err()
        .to_string();
    assert!(err.starts_with("k.pem: no private key in it"), "{err}");
}
