//! Where an S3 origin's credentials come from, and a quick answer when there are none.
//!
//! Owns `check_s3_credentials`: with no credentials in the environment the S3 client's last
//! resort is the instance metadata service, and off an EC2 instance that address answers 403
//! through a proxy or drops every packet, which the client retries for three minutes before it
//! says "error sending request". The check asks the metadata service once, with a short
//! timeout, before any request, and refuses naming the variables to set. Never: reads, logs or
//! keeps a credential (it only looks at which variables are set), or asks the service for one
//! (the client does that itself when the answer says the service is there).

use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::Duration;

use crate::error::{Error, Result};

/// How long the metadata service has to accept the connection, and then to answer.
const METADATA_PATIENCE: Duration = Duration::from_secs(2);

/// Where the client would take credentials from, in its own order.
#[derive(Debug, PartialEq, Eq)]
enum Source {
    /// Keys, web identity, a container's endpoint, or no signing at all: set by the user.
    Configured,
    /// Nothing configured: the instance metadata service at this URL.
    Instance(String),
}

fn source(var: &dyn Fn(&str) -> Option<String>) -> Source {
    let set = |name: &str| var(name).is_some_and(|v| !v.trim().is_empty());
    let truthy = |name: &str| var(name).is_some_and(|v| matches!(v.trim().to_ascii_lowercase().as_str(), "true" | "1"));
    if set("AWS_ACCESS_KEY_ID")
        || set("AWS_WEB_IDENTITY_TOKEN_FILE")
        || set("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI")
        || set("AWS_CONTAINER_CREDENTIALS_FULL_URI")
        || truthy("AWS_SKIP_SIGNATURE")
    {
        return Source::Configured;
    }
    Source::Instance(var("AWS_METADATA_ENDPOINT").unwrap_or_else(|| "http://169.254.169.254".to_owned()))
}

/// Refuses, within a few seconds and before any request, an S3 origin that has no credentials
/// in the environment where the instance metadata service does not answer (see the module doc).
pub(super) fn check_s3_credentials(origin: &str) -> Result<()> {
    let Source::Instance(endpoint) = source(&|name| std::env::var(name).ok()) else { return Ok(()) };
    match ask_metadata_service(&endpoint) {
        Ok(()) => Ok(()),
        Err(why) => {
            let profile = match std::env::var("AWS_PROFILE") {
                Ok(_) => {
                    " (AWS_PROFILE is set, but profiles in ~/.aws are not read: export the profile's keys, \
                     e.g. `eval \"$(aws configure export-credentials --format env)\"`)"
                }
                Err(_) => "",
            };
            Err(Error::invalid_input(format!(
                "origin {origin}: no S3 credentials: none in the environment, and the instance metadata service \
                 ({endpoint}) {why}: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN for \
                 temporary keys), or AWS_SKIP_SIGNATURE=true for a public bucket{profile}"
            )))
        }
    }
}

/// Asks for an IMDSv2 session token, as the client would first; `Err` says how it failed.
/// Any answer but a refusal means the service is there (the client handles the rest).
fn ask_metadata_service(endpoint: &str) -> std::result::Result<(), String> {
    let url = url::Url::parse(endpoint).map_err(|e| format!("is not a URL ({e})"))?;
    if url.scheme() != "http" {
        // Not something to speak to by hand: the client's own request decides.
        return Ok(());
    }
    let host = url.host_str().ok_or("names no host")?;
    let port = url.port().unwrap_or(80);
    let address = (host, port)
        .to_socket_addrs()
        .map_err(|e| format!("could not be resolved ({e})"))?
        .next()
        .ok_or("could not be resolved")?;
    let mut stream = TcpStream::connect_timeout(&address, METADATA_PATIENCE)
        .map_err(|e| format!("could not be reached ({e}; not a cloud instance?)"))?;
    stream.set_read_timeout(Some(METADATA_PATIENCE)).map_err(|e| e.to_string())?;
    stream.set_write_timeout(Some(METADATA_PATIENCE)).map_err(|e| e.to_string())?;
    let request = format!(
        "PUT /latest/api/token HTTP/1.1\r\nHost: {host}\r\nX-aws-ec2-metadata-token-ttl-seconds: 60\r\n\
         Content-Length: 0\r\nConnection: close\r\n\r\n"
    );
    stream.write_all(request.as_bytes()).map_err(|e| format!("could not be asked ({e})"))?;
    let mut head = [0_u8; 64];
    let mut got = 0;
    while got < 12 {
        match stream.read(&mut head[got..]) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) => {
                return Err(format!(
                    "did not answer within {} s ({e}; not a cloud instance?)",
                    METADATA_PATIENCE.as_secs()
                ));
            }
        }
    }
    let status = std::str::from_utf8(&head[..got])
        .ok()
        .and_then(|line| line.strip_prefix("HTTP/1."))
        .and_then(|rest| rest.get(2..5))
        .and_then(|code| code.parse::<u16>().ok())
        .ok_or("answered something that is not HTTP")?;
    match status {
        200..=299 => Ok(()),
        // Forbidden or gone, from a proxy or a service that does not issue tokens here.
        _ => Err(format!("answered HTTP {status}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn any_configured_source_skips_the_check_and_nothing_configured_names_the_endpoint() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |name: &str| pairs.iter().find(|(k, _)| *k == name).map(|(_, v)| (*v).to_owned())
        };
        assert_eq!(source(&env(&[("AWS_ACCESS_KEY_ID", "x")])), Source::Configured);
        assert_eq!(source(&env(&[("AWS_WEB_IDENTITY_TOKEN_FILE", "/t")])), Source::Configured);
        assert_eq!(source(&env(&[("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "/v2")])), Source::Configured);
        assert_eq!(source(&env(&[("AWS_SKIP_SIGNATURE", "true")])), Source::Configured);
        assert_eq!(source(&env(&[("AWS_SKIP_SIGNATURE", "false")])), Source::Instance("http://169.254.169.254".into()));
        assert_eq!(source(&env(&[("AWS_ACCESS_KEY_ID", " ")])), Source::Instance("http://169.254.169.254".into()));
        assert_eq!(
            source(&env(&[("AWS_METADATA_ENDPOINT", "http://127.0.0.1:9")])),
            Source::Instance("http://127.0.0.1:9".into())
        );
    }

    #[test]
    fn a_service_that_answers_passes_and_one_that_refuses_or_is_silent_is_named() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let answers = std::thread::spawn(move || {
            for reply in ["HTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\nt", "HTTP/1.1 403 Forbidden\r\n\r\n"] {
                let (mut stream, _) = listener.accept().unwrap();
                let mut request = [0_u8; 512];
                let _ = stream.read(&mut request).unwrap();
                assert!(std::str::from_utf8(&request).unwrap().starts_with("PUT /latest/api/token "));
                stream.write_all(reply.as_bytes()).unwrap();
            }
            // Accepted by the kernel, never answered.
            let (_silent, _) = listener.accept().unwrap();
            std::thread::sleep(Duration::from_secs(3));
        });
        let endpoint = format!("http://127.0.0.1:{port}");
        assert_eq!(ask_metadata_service(&endpoint), Ok(()));
        assert_eq!(ask_metadata_service(&endpoint), Err("answered HTTP 403".to_owned()));
        let started = std::time::Instant::now();
        let silent = ask_metadata_service(&endpoint).unwrap_err();
        assert!(silent.starts_with("did not answer within 2 s"), "{silent}");
        assert!(started.elapsed() < Duration::from_secs(4));
        answers.join().unwrap();
    }
}
