package lockmesh

import (
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"net"
	"os"
	"strings"
	"sync"
	"time"
)

// Config of a Client. NewConfig fills the defaults (those of the Rust SDK).
type Config struct {
	// Endpoint is the lock tier's https://host:port.
	Endpoint string
	// CAFile, CertFile, KeyFile: the tier's trust root; the workload's SVID and key (PEM).
	CAFile, CertFile, KeyFile string
	// Resolve, when set ("127.0.0.1:18000"), is dialled instead of resolving the host.
	Resolve string
	// Margin is subtracted from the TTL for the fence deadline; below every TTL.
	Margin time.Duration
	// AcquireSlack is added to the wait for an acquire's request timeout and its
	// resolution time.
	AcquireSlack time.Duration
	// RequestTimeout bounds open, release, holds, close; keepalives use min(this, TTL/6).
	RequestTimeout time.Duration
	// TierRequestTimeout: when the late check of a lost answer runs (Envoy's 45 s).
	TierRequestTimeout time.Duration
	// CertReload: how often the three files are re-read; 0 reads them once.
	CertReload time.Duration
}

// NewConfig returns a Config with the defaults: margin 1 s, acquire slack 5 s,
// request timeout 5 s, tier request timeout 45 s, certificate reload 10 s.
func NewConfig(endpoint, caFile, certFile, keyFile string) Config {
	return Config{
		Endpoint: endpoint, CAFile: caFile, CertFile: certFile, KeyFile: keyFile,
		Margin: time.Second, AcquireSlack: 5 * time.Second, RequestTimeout: 5 * time.Second,
		TierRequestTimeout: 45 * time.Second, CertReload: 10 * time.Second,
	}
}

func (c *Config) validate() error {
	if !strings.HasPrefix(c.Endpoint, "https://") {
		return configErr("endpoint", "must be https://host:port")
	}
	for name, v := range map[string]string{"ca": c.CAFile, "cert": c.CertFile, "key": c.KeyFile} {
		if v == "" {
			return configErr(name, "required")
		}
	}
	if c.Margin <= 0 {
		return configErr("margin", "must be above zero")
	}
	if c.RequestTimeout <= 0 || c.AcquireSlack < 0 || c.TierRequestTimeout < 0 {
		return configErr("timeouts", "request timeout above zero, slack and tier timeout not negative")
	}
	if c.Resolve != "" {
		if _, _, err := net.SplitHostPort(c.Resolve); err != nil {
			return configErr("resolve", "not host:port")
		}
	}
	return nil
}

// certSource re-reads the client certificate and CA every CertReload; each new
// connection uses the set current at its handshake.
type certSource struct {
	cfg    Config
	mu     sync.Mutex
	read   time.Time
	cert   *tls.Certificate
	roots  *x509.CertPool
	failed error
}

func (s *certSource) load(now time.Time) (*tls.Certificate, *x509.CertPool, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.cert != nil && (s.cfg.CertReload <= 0 || now.Sub(s.read) < s.cfg.CertReload) {
		return s.cert, s.roots, nil
	}
	cert, err := tls.LoadX509KeyPair(s.cfg.CertFile, s.cfg.KeyFile)
	if err != nil {
		if s.cert != nil { // keep the last good set
			return s.cert, s.roots, nil
		}
		return nil, nil, configErr("cert", fmt.Sprintf("cannot load the certificate and key: %v", err))
	}
	pem, err := os.ReadFile(s.cfg.CAFile)
	if err != nil {
		if s.cert != nil {
			return s.cert, s.roots, nil
		}
		return nil, nil, configErr("ca", fmt.Sprintf("cannot read: %v", err))
	}
	roots := x509.NewCertPool()
	if !roots.AppendCertsFromPEM(pem) {
		if s.cert != nil {
			return s.cert, s.roots, nil
		}
		return nil, nil, configErr("ca", "no PEM certificate in the file")
	}
	s.cert, s.roots, s.read = &cert, roots, now
	return s.cert, s.roots, nil
}

// tlsConfig verifies the tier against the configured CA only (no system roots)
// and presents the workload's certificate; HTTP/2 or HTTP/1.1 by ALPN.
func (s *certSource) tlsConfig(serverName string) *tls.Config {
	return &tls.Config{
		MinVersion: tls.VersionTLS12,
		ServerName: serverName,
		// Verification is done in VerifyConnection against the current roots.
		InsecureSkipVerify: true, //nolint:gosec // verified below against the configured CA
		VerifyConnection: func(cs tls.ConnectionState) error {
			_, roots, err := s.load(time.Now())
			if err != nil {
				return err
			}
			if len(cs.PeerCertificates) == 0 {
				return fmt.Errorf("the tier presented no certificate")
			}
			inter := x509.NewCertPool()
			for _, c := range cs.PeerCertificates[1:] {
				inter.AddCert(c)
			}
			_, err = cs.PeerCertificates[0].Verify(x509.VerifyOptions{
				DNSName: serverName, Roots: roots, Intermediates: inter,
				KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
			})
			return err
		},
		GetClientCertificate: func(*tls.CertificateRequestInfo) (*tls.Certificate, error) {
			c, _, err := s.load(time.Now())
			return c, err
		},
		NextProtos: []string{"h2", "http/1.1"},
	}
}
