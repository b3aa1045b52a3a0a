package lockmesh_test

import (
	"context"
	"log"
	"time"

	lockmesh "github.com/lockmesh/lockmesh/client/go"
)

func writeWithFence(ctx context.Context, token uint64, proof string) error { return nil }

// The docs/SDK.md example, compiled by go vet and go test (not run: it needs a tier).
func ExampleClient_Lock() {
	ctx := context.Background()
	cfg := lockmesh.NewConfig("https://lock-tier:18000", "ca.pem", "svid.pem", "svid-key.pem")
	client, err := lockmesh.New(cfg, func(f lockmesh.FenceEvent) {
		log.Printf("lost %d locks: %s", len(f.Keys), f.Reason) // required (ADR-12)
	})
	if err != nil {
		log.Fatal(err)
	}
	g, err := client.Lock(ctx, "payments/order-42", lockmesh.LockOptions{Wait: 5 * time.Second})
	if err != nil {
		log.Fatal(err) // errors.Is(err, lockmesh.ErrContended), ...
	}
	defer g.Unlock()
	for g.CanStartWork() && g.RemainingTTL() > 2*time.Second {
		if err := writeWithFence(g.Context(), g.Token(), g.Proof()); err != nil {
			log.Fatal(err)
		}
	}
}

// An election: campaign until leader, work while leader, resign.
func ExampleClient_Campaign() {
	ctx := context.Background()
	client, err := lockmesh.New(lockmesh.NewConfig("https://lock-tier:18000", "ca.pem", "svid.pem", "svid-key.pem"),
		func(lockmesh.FenceEvent) {})
	if err != nil {
		log.Fatal(err)
	}
	addr := "10.0.0.7:8443"
	leader, err := client.Campaign(ctx, "coord/report-scheduler", lockmesh.CampaignOptions{Value: &addr})
	if err != nil {
		log.Fatal(err)
	}
	defer leader.Resign()
	for leader.CanStartWork() {
		if err := writeWithFence(leader.Context(), leader.Token(), leader.Proof()); err != nil {
			break
		}
	}
}
